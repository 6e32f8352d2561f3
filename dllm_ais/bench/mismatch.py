"""How far each rollout precision moves the policy: exact token KL(trainer ‖ engine), per token and per sequence,
for each precision flow side by side (`rollout.precision_flow`: split, the trainer in high precision; unified, the
trainer computing with the engine's quantized linears).

    dllm-ais bench mismatch                  # the embedded models, every low-precision mode and the FP8 KV cache
    dllm-ais bench mismatch --prompts 256 --precisions fp8,int4 --kv-cache none --flows unified
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
  |log ρ_seq|  the mean over completions of |Σ_t log ρ_t|;
  sampling s  wall seconds of the engine's sampling of those completions, on one CPU thread: what the notch costs
          emulated here (include bf16 in --precisions for its baseline), not a GPU speed (`dllm-ais bench precision`).

With the unified flow the trainer is a copy of the model whose linears compute the engine's numerics
(`engine.quantize_trainer_model_`), run with gradients on as ℓ_θ is, and the engine samples with that same model; the
trajectory replay runs micro-batch by micro-batch (the recipe's per_device_train_batch_size) as training scores it,
so a per-tensor activation scale (fp8_tensor, nvfp4) sees a batch other than the sampler's.

A second table scores LLaDA's rollouts on the trajectory estimator's canvases instead (the replay's per-step canvases:
each token under the canvas of the step that committed it; `likelihood.estimator=trajectory`): the same figures but
the exact KL, for every precision, and for the FP8 KV cache (`rollout.cache_dtype=fp8`; the recipe's cache, dual if
it has none): the log-probs a bf16 engine recorded sampling with the FP8-stored cache against the trainer replaying
the same cached decoder with its cache in full precision (`experimental.likelihood_decoder=rollout`, the trajectory
estimator that scores the cache) — the one-step canvas runs without a cache, so the cache's storage changes nothing
there.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

from dllm_ais.bench.common import describe_device
from dllm_ais.choices import PRECISION_FLOWS
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.engine import RolloutEngine
from dllm_ais.likelihood import one_step_masked_input
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.models.families import position_logits
from dllm_ais.ops import normalised_effective_sample_size
from dllm_ais.policy import build_policy, is_diffusion
from dllm_ais.quantization import PRECISIONS

RECIPES = {"llada": EMBEDDED_RECIPE,  # the embedded models' recipes, by name; the others from a source checkout
           "llada-chain-sum": Path(__file__).resolve().parents[2] / "recipes" / "tiny_llada_chain_sum.yaml",
           "qwen3": Path(__file__).resolve().parents[2] / "recipes" / "tiny_qwen3_digits_fp8_ais.yaml",
           "dream": Path(__file__).resolve().parents[2] / "recipes" / "tiny_dream_digits.yaml",
           "sdar": Path(__file__).resolve().parents[2] / "recipes" / "tiny_sdar_digits.yaml",
           "llada2": Path(__file__).resolve().parents[2] / "recipes" / "tiny_llada2_digits.yaml"}
KV_CACHE_NOTCH = "bf16 + fp8 KV cache"


def completion_log_probs(model, config, rollout, diffusion: bool) -> torch.Tensor:
    """log-softmax [B, L, V] (float32) at the completion positions, on the canvas the likelihood stage scores."""
    length = rollout.gen_length
    if diffusion:
        canvas = one_step_masked_input(rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                                       model.config.mask_token_id, seed=0, p_mask_prompt=config.likelihood.p_mask_prompt)
        logits = position_logits(model, canvas, rollout.attention_mask, length)
    else:
        positions = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask, position_ids=positions,
                       logits_to_keep=length + 1).logits[:, :-1]
    return logits.float().log_softmax(-1)


def effective_sample_size(log_ratio: torch.Tensor) -> float:
    """The normalised ESS of ρ = exp(log_ratio) [N], shifted by the largest log ratio (ESS is scale-free)."""
    weights = (log_ratio.double() - log_ratio.max()).exp()
    return normalised_effective_sample_size(weights, torch.ones_like(weights, dtype=torch.bool)).item()


def ratio_statistics(token_log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The figures of log ρ_t = log π_trainer − log π_engine [B, L] at the completion tokens `mask`: k3 (mean of
    ρ − log ρ − 1), max |log ρ|, token ESS, mean |Σ_t log ρ_t| over completions, sequence ESS, mean tokens."""
    token_log_ratio = token_log_ratio * mask
    log_ratio, sequence_log_ratio = token_log_ratio[mask], token_log_ratio.sum(-1)
    return {"k3": (log_ratio.exp() - log_ratio - 1).mean().item(), "max_abs_log_ratio": log_ratio.abs().max().item(),
            "token_ess": effective_sample_size(log_ratio),
            "mean_abs_sequence_log_ratio": sequence_log_ratio.abs().mean().item(),
            "sequence_ess": effective_sample_size(sequence_log_ratio),
            "completion_tokens": mask.sum(-1).double().mean().item()}


def log_ratio_cells(statistics: dict[str, float]) -> list[str]:
    """`ratio_statistics` as the tables' cells."""
    return [f"{statistics['k3']:.2e}", f"{statistics['max_abs_log_ratio']:.3f}", f"{statistics['token_ess']:.4f}",
            f"{statistics['mean_abs_sequence_log_ratio']:.3f}", f"{statistics['sequence_ess']:.4f}",
            f"{statistics['completion_tokens']:.1f}"]


def trajectory_statistics(policy, trainer, rollout, micro_batch_size: int | None = None) -> dict[str, float]:
    """`ratio_statistics` of `policy`'s estimator as the trainer meets it: the trainer's log-probs of `rollout`
    (`micro_batch_size` rows at a time; None = all at once) against the rollout side (`rollout_logprobs`: for the
    trajectory estimator what the engine's sampler recorded)."""
    size = micro_batch_size or len(rollout.sequences)
    trainer_logprobs = torch.cat([policy.logprobs(trainer, rollout.select(slice(start, start + size)), seed=0)
                                  for start in range(0, len(rollout.sequences), size)])
    log_ratio = trainer_logprobs - policy.rollout_logprobs(None, rollout, seed=0)
    return ratio_statistics(log_ratio, rollout.completion_mask)


@dataclasses.dataclass(frozen=True)
class NotchMismatch:
    """One precision's mismatch on one model: the exact token KL and `ratio_statistics` on the canvas the one-step
    estimator (causal LM: teacher forcing) scores, on the trajectory replay's canvases (diffusion only), and the
    engine's sampling seconds."""

    kl: float
    scored_canvas: dict[str, float]
    trajectory: dict[str, float] | None
    sampling_seconds: float


def measure_notch(config, model, policy, precision: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  seed: int, flow: str = "split") -> NotchMismatch:
    """Sample completions of the prompts with `model`'s rollout engine at `precision` in precision flow `flow`
    (temperature 1, the recipe's decoder) and measure the trainer's mismatch to it on them: split, the trainer is
    `model`; unified, a copy of `model` computing with the engine's quantized linears, which the engine shares."""
    diffusion = is_diffusion(config.policy, model.config.model_type)
    trainer = copy.deepcopy(model) if flow == "unified" else model
    engine = RolloutEngine(trainer, precision=precision, precision_flow=flow).model
    start = time.perf_counter()
    rollout = policy.sample(engine, input_ids, attention_mask, torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - start
    mask, tokens = rollout.completion_mask, rollout.completion_ids.unsqueeze(-1)
    with torch.enable_grad():  # the trainer's side as ℓ_θ computes it
        reference = completion_log_probs(trainer, config, rollout, diffusion).detach()
    engine_logp = completion_log_probs(engine, config, rollout, diffusion)
    kl = (reference.exp() * (reference - engine_logp)).sum(-1)[mask].mean().item()
    token_log_ratio = (reference.gather(-1, tokens) - engine_logp.gather(-1, tokens)).squeeze(-1)
    trajectory = None if not diffusion else trajectory_statistics(
        with_trajectory_estimator(policy), trainer, rollout, config.per_device_train_batch_size)
    return NotchMismatch(kl, ratio_statistics(token_log_ratio, mask), trajectory, seconds)


def with_trajectory_estimator(policy):
    """The diffusion `policy` scoring with the trajectory estimator (the replay of its recorded denoising steps)."""
    return dataclasses.replace(policy, likelihood=dataclasses.replace(policy.likelihood, estimator="trajectory"))


def validation_prompts(config, tokenizer, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` validation prompts of the recipe's task, tokenized as training does: (input_ids, attention_mask)."""
    prompts = load_task_dataset(config.task, "validation", size=size, seed=seed, task_args=config.task_args)["prompt"]
    return tokenize_prompts(tokenizer, prompts, config.max_prompt_length)


def kv_cache_policy(policy):
    """`policy` sampling with the FP8-stored block KV cache (the recipe's cache, dual if it has none) and replaying
    that cached decoder (in full precision) to score."""
    config = policy.sampler_config
    cached = dataclasses.replace(config, cache="dual" if config.cache == "none" else config.cache, cache_dtype="fp8")
    return dataclasses.replace(policy, likelihood_order="rollout", likelihood_decoder="rollout").with_decoder(cached)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dllm-ais bench mismatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llada,llada-chain-sum,qwen3",
                        help="comma-separated: llada / llada-chain-sum / qwen3 / dream / sdar / llada2 (the embedded models' "
                             "recipes) "
                             "or recipe paths")
    parser.add_argument("--precisions", default=",".join(p for p in PRECISIONS if p != "bf16"))
    parser.add_argument("--kv-cache", choices=("fp8", "none"), default="fp8",
                        help="fp8: also the FP8 KV cache notch on the trajectory canvases; none: leave it out")
    parser.add_argument("--flows", default=",".join(PRECISION_FLOWS),
                        help="comma-separated precision flows (rollout.precision_flow), each measured per precision")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="the trainer's micro-batch for the trajectory replay (per_device_train_batch_size; default: "
                             "the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"device: {describe_device(torch.device('cpu'))}, torch {torch.__version__}, float32 trainer; "
          f"{args.prompts} validation prompts per model, completions sampled by the engine at temperature 1")
    print("| model | precision | flow | token KL(trainer ‖ engine) | k3 of the engine's tokens | max abs Δ log p "
          "| ESS, token | mean abs log ρ_seq | ESS, sequence | completion tokens | sampling s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    trajectory_tables = []
    for name in args.models.split(","):
        micro_batch = [] if args.micro_batch is None else [f"--per_device_train_batch_size={args.micro_batch}"]
        config = load_config(RECIPES.get(name, name), ["--output_dir=/tmp/unused", *micro_batch])
        tokenizer = load_tokenizer(config.model_name_or_path)
        model = load_model(config.model_name_or_path, torch.float32).eval()
        diffusion = is_diffusion(config.policy, model.config.model_type)
        input_ids, attention_mask = validation_prompts(config, tokenizer, args.prompts, args.seed)
        policy = build_policy(config, model.config, tokenizer, temperature=1.0)
        trajectory_rows = []
        for precision in args.precisions.split(","):
            for flow in args.flows.split(","):
                notch = measure_notch(config, model, policy, precision, input_ids, attention_mask, args.seed, flow)
                print(f"| {name} ({config.model_name_or_path}) | {precision} | {flow} | {notch.kl:.2e} | "
                      + " | ".join(log_ratio_cells(notch.scored_canvas)) + f" | {notch.sampling_seconds:.2f} |")
                sys.stdout.flush()
                if notch.trajectory is not None:
                    trajectory_rows.append((precision, flow, log_ratio_cells(notch.trajectory)))
        if diffusion and args.kv_cache == "fp8":
            cached = kv_cache_policy(with_trajectory_estimator(policy))
            engine = RolloutEngine(model, precision="bf16").model
            rollout = cached.sample(engine, input_ids, attention_mask, torch.Generator().manual_seed(args.seed))
            trajectory_rows.append((f"{KV_CACHE_NOTCH} ({cached.sampler_config.cache})", "split",
                                    log_ratio_cells(trajectory_statistics(cached, model, rollout))))
        trajectory_tables.append((name, config.model_name_or_path, trajectory_rows))
    print_trajectory_table(trajectory_tables)


def print_trajectory_table(tables: list[tuple[str, str, list[tuple[str, str, list[str]]]]]) -> None:
    """The trajectory canvases' table: one row per (model, notch, flow) of the diffusion models."""
    rows = [(name, path, notch, flow, cells) for name, path, notch_rows in tables for notch, flow, cells in notch_rows]
    if not rows:
        return
    print("\ntrajectory estimator's canvases (each token under the canvas of the step that committed it):")
    print("| canvas | model | notch | flow | k3 of the engine's tokens | max abs Δ log p | ESS, token "
          "| mean abs log ρ_seq | ESS, sequence | completion tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, path, notch, flow, cells in rows:
        print(f"| trajectory | {name} ({path}) | {notch} | {flow} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
