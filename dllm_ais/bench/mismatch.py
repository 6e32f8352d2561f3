"""How far each rollout precision moves the policy: exact token KL(trainer ‖ engine), per token and per sequence.

    dllm-ais bench mismatch                  # both embedded models, every low-precision mode
    dllm-ais bench mismatch --prompts 256 --precisions fp8,int4
    dllm-ais bench mismatch --models recipes/tiny_llada_chain_sum.yaml,recipes/tiny_qwen3_chain_sum.yaml

For each model and precision, completions are sampled (temperature 1) by the rollout engine for validation prompts
of its task, as in training. Then, on exactly the canvases the likelihood stage scores — causal LM: the prompt +
completion, teacher-forced; LLaDA: the one-step canvas (the recipe's prompt masking, fully masked completion) — the
trainer's and the engine's full next-token distributions are compared at every completion position:

  KL      mean over positions of KL(π_trainer ‖ π_engine), exact over the vocabulary;
  k3      mean over the engine's sampled tokens of ρ − log ρ − 1 with ρ = π_trainer / π_engine: the estimate of
          KL(π_engine ‖ π_trainer) the trainer logs as rollout_corr/k3_kl;
  max|Δ|  the largest |log π_trainer − log π_engine| over the sampled tokens;
  ESS     the normalised effective sample size (Σ ρ)² / (N Σ ρ²) of the importance ratios: per token (N sampled
          tokens) and per sequence (ρ_seq = Π_t ρ_t over a completion, N completions) — the sequence ratio is where a
          long completion's small per-token mismatch compounds;
  |log ρ_seq|  the mean over completions of |Σ_t log ρ_t|.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dllm_ais.bench.common import describe_device
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.engine import RolloutEngine
from dllm_ais.likelihood import one_step_masked_input
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.ops import normalised_effective_sample_size
from dllm_ais.policy import build_policy, is_diffusion
from dllm_ais.quantization import PRECISIONS

RECIPES = {"llada": EMBEDDED_RECIPE,  # the embedded models' recipes, by name; the Qwen3 one from a source checkout
           "qwen3": Path(__file__).resolve().parents[2] / "recipes" / "tiny_qwen3_digits_fp8_ais.yaml"}


@torch.no_grad()
def completion_log_probs(model, config, rollout, diffusion: bool) -> torch.Tensor:
    """log-softmax [B, L, V] (float32) at the completion positions, on the canvas the likelihood stage scores."""
    length = rollout.gen_length
    if diffusion:
        canvas = one_step_masked_input(rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                                       model.config.mask_token_id, seed=0, p_mask_prompt=config.likelihood.p_mask_prompt)
        logits = model(input_ids=canvas, attention_mask=rollout.attention_mask, logits_to_keep=length).logits
    else:
        positions = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask, position_ids=positions,
                       logits_to_keep=length + 1).logits[:, :-1]
    return logits.float().log_softmax(-1)


def effective_sample_size(log_ratio: torch.Tensor) -> float:
    """The normalised ESS of ρ = exp(log_ratio) [N], shifted by the largest log ratio (ESS is scale-free)."""
    weights = (log_ratio.double() - log_ratio.max()).exp()
    return normalised_effective_sample_size(weights, torch.ones_like(weights, dtype=torch.bool)).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench mismatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llada,qwen3",
                        help="comma-separated: llada / qwen3 (the embedded models' recipes) or recipe paths")
    parser.add_argument("--precisions", default=",".join(p for p in PRECISIONS if p != "bf16"))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"device: {describe_device(torch.device('cpu'))}, torch {torch.__version__}, float32 trainer; "
          f"{args.prompts} validation prompts per model, completions sampled by the engine at temperature 1")
    print("| model | precision | token KL(trainer ‖ engine) | k3 of the engine's tokens | max abs Δ log p | ESS, token "
          "| mean abs log ρ_seq | ESS, sequence | completion tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        config = load_config(RECIPES.get(name, name), ["--output_dir=/tmp/unused"])
        tokenizer = load_tokenizer(config.model_name_or_path)
        model = load_model(config.model_name_or_path, torch.float32).eval()
        diffusion = is_diffusion(config.policy, model.config.model_type)
        prompts = load_task_dataset(config.task, "validation", size=args.prompts, seed=args.seed,
                                    task_args=config.task_args)["prompt"]
        input_ids, attention_mask = tokenize_prompts(tokenizer, prompts, config.max_prompt_length)
        policy = build_policy(config, model.config, tokenizer, temperature=1.0)
        for precision in args.precisions.split(","):
            engine = RolloutEngine(model, precision=precision).model
            rollout = policy.sample(engine, input_ids, attention_mask, torch.Generator().manual_seed(args.seed))
            mask, tokens = rollout.completion_mask, rollout.completion_ids.unsqueeze(-1)
            reference = completion_log_probs(model, config, rollout, diffusion)
            engine_logp = completion_log_probs(engine, config, rollout, diffusion)
            kl = (reference.exp() * (reference - engine_logp)).sum(-1)[mask].mean().item()
            token_log_ratio = (reference.gather(-1, tokens) - engine_logp.gather(-1, tokens)).squeeze(-1) * mask
            log_ratio = token_log_ratio[mask]
            k3 = (log_ratio.exp() - log_ratio - 1).mean().item()
            sequence_log_ratio = token_log_ratio.sum(-1)
            print(f"| {name} ({config.model_name_or_path}) | {precision} | {kl:.2e} | {k3:.2e} | "
                  f"{log_ratio.abs().max().item():.3f} | {effective_sample_size(log_ratio):.4f} | "
                  f"{sequence_log_ratio.abs().mean().item():.3f} | {effective_sample_size(sequence_log_ratio):.4f} | "
                  f"{mask.sum(-1).double().mean().item():.1f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
