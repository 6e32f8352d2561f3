"""Rebuild the embedded tiny models: tokenizer, config and SFT warm start on the digits task.

    python scripts/build_tiny_model.py                  # tiny LLaDA  -> dllm_ais/assets/tiny_llada  (masked-diffusion SFT)
    python scripts/build_tiny_model.py --family qwen3   # tiny Qwen3  -> dllm_ais/assets/tiny_qwen3  (next-token SFT)

About 15 (LLaDA) and 5 (Qwen3) minutes on one CPU thread (OMP_NUM_THREADS=1), deterministic for a given torch build.

The warm start learns from noisy demonstrations (`--descending-sort-fraction`, default 0.6): most of its `sort`
examples sort in descending order, so the greedy model answers most `sort` prompts the wrong way round while it
copies and reverses correctly. The reward knows the right order and the RL data is untouched: that leaves the
embedded runs headroom GRPO can reach in a minute or two on a CPU — a behaviour the model can already produce
(40 % of its `sort` demonstrations) and must learn to prefer. Without it, the remaining errors of an SFT model this
small are copying errors that a hundred RL steps barely move (BENCHMARKS.md, "Why the embedded runs did not learn").
Prints the greedy validation reward of the result.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.insert(0, str(Path(__file__).parent))
from build_tokenizer import build_hf_tokenizer  # noqa: E402

from dllm_ais.checkpoint import atomic_directory  # noqa: E402
from dllm_ais.config import EMBEDDED_MODELS, GRPOConfig  # noqa: E402
from dllm_ais.data import load_task_dataset  # noqa: E402
from dllm_ais.evaluation import evaluate_policy  # noqa: E402
from dllm_ais.models import LLaDAConfig, LLaDAModelLM  # noqa: E402
from dllm_ais.policy import build_policy  # noqa: E402
from dllm_ais.sft import SFTConfig, run_sft  # noqa: E402
from dllm_ais.tasks.digits import TASK as DIGITS  # noqa: E402


def tiny_model(family: str, tokenizer, d_model: int, n_layers: int) -> torch.nn.Module:
    vocab = len(tokenizer)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family == "llada":
        return LLaDAModelLM(LLaDAConfig(
            d_model=d_model, n_heads=4, n_kv_heads=4, n_layers=n_layers, mlp_hidden_size=3 * d_model, vocab_size=vocab,
            embedding_size=vocab, max_sequence_length=512, rope_theta=10000.0, mask_token_id=tokenizer.mask_token_id,
            **ids))
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=3 * d_model, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=d_model // 4, max_position_embeddings=512,
        tie_word_embeddings=False, **ids))


def noisy_demonstrations(dataset, descending_sort_fraction: float, seed: int):
    """The SFT data of the warm start: the digits task's demonstrations, except that a share of the `sort` ones
    sort in descending order — the habit an imperfect demonstrator leaves in a model. The reward knows the
    right order (the RL data is untouched), so RL has a behaviour to find in the model's own samples."""
    rng = random.Random(seed)

    def demonstrate(row):
        operation = row["prompt"][0]["content"].split()[0]
        if operation == "sort" and rng.random() < descending_sort_fraction:
            return {"answer": " ".join(sorted(row["answer"].split(), reverse=True))}
        return {}

    return dataset.map(demonstrate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("llada", "qwen3"), default="llada")
    parser.add_argument("--output-dir", type=Path)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default: llada 2400, qwen3 800")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=None, help="default: llada 1e-3, qwen3 2e-3")
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--descending-sort-fraction", type=float, default=0.6,
                        help="share of the 'sort' demonstrations that sort in the wrong (descending) order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # The masked-diffusion objective learns slower and is less stable at a high rate (2e-3: loss 0.52 after 2400
    # steps, greedy reward 0.29) than next-token SFT at the same size.
    args.steps = args.steps or {"llada": 2400, "qwen3": 800}[args.family]
    args.learning_rate = args.learning_rate or {"llada": 1e-3, "qwen3": 2e-3}[args.family]
    name = "embedded" if args.family == "llada" else "embedded-qwen3"
    output_dir = args.output_dir or EMBEDDED_MODELS[name]

    torch.manual_seed(args.seed)
    tokenizer = build_hf_tokenizer()
    tokenizer.padding_side = "left"
    model = tiny_model(args.family, tokenizer, args.d_model, args.n_layers)
    train = noisy_demonstrations(load_task_dataset("digits", "train", seed=args.seed), args.descending_sort_fraction,
                                 args.seed)
    mask_id = tokenizer.mask_token_id if args.family == "llada" else None
    losses = run_sft(model, tokenizer, train, SFTConfig(steps=args.steps, batch_size=args.batch_size,
                                                        learning_rate=args.learning_rate, gen_length=args.gen_length,
                                                        seed=args.seed), mask_token_id=mask_id)
    config = GRPOConfig(policy="diffusion" if args.family == "llada" else "autoregressive", task="digits",
                        max_completion_length=args.gen_length, block_length=args.gen_length,
                        diffusion_steps=args.gen_length // 2)
    policy = build_policy(config, model.config, tokenizer, temperature=0.0)
    held_out = load_task_dataset("digits", "validation", size=128, seed=args.seed)
    score = evaluate_policy(model, tokenizer, policy, held_out, list(DIGITS.reward_funcs), batch_size=64).summary()
    recipe = output_dir / "recipe.yaml"
    with atomic_directory(output_dir, overwrite=True) as staging:  # replaces only a directory it wrote
        model.save_pretrained(staging, safe_serialization=True)
        build_hf_tokenizer().save_pretrained(staging)  # as built: padding side is set by the loader, not stored
        if recipe.is_file():
            (staging / "recipe.yaml").write_text(recipe.read_text())
    print(f"{args.family}: SFT loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f} over {args.steps} steps; greedy "
          f"held-out digits reward {score['eval/reward']:.3f} (128 prompts); written to {output_dir}")


if __name__ == "__main__":
    main()
