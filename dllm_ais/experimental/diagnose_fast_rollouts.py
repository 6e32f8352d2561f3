"""Why fast diffusion rollouts teach a trajectory-type estimator something else: the approximation split into parts.

    python -m dllm_ais.experimental.diagnose_fast_rollouts     # the embedded LLaDA, 128 prompts x 4 completions
    python -m dllm_ais.experimental.diagnose_fast_rollouts --model outputs/tiny-digits-fp8-ais/final --prompts 256

Each decoder samples the same validation prompts (temperature 1, the recipe's schedule) from the full-precision
model itself, so precision plays no part: what differs is the decoding alone. Per decoder:

- (a) what an importance ratio can see: the per-token log-ratio between the log-probs the decoder recorded and the
  trainer's replay of the same order (trajectory estimator, no cache) — k3 and mean |log ρ|. Parallel commits
  leave it at 0 (the tokens are drawn from exact logits, just more of them per forward); a cache does not.
- (b) the visited-state shift: the same completions replayed along the exact decoder's order
  (`MaskedDiffusionSampler.replay`: low confidence, the fixed schedule) — the share of position pairs the two orders
  commit in different order (Kendall distance; a pair committed in one step by either counts half), the mean
  number of already-committed completion tokens a token sees when it is committed (its context), and the per-token
  log-likelihood along each order. Exact rollouts are themselves not their replay (at temperature 1 uncommitted
  positions are redrawn): their row is the baseline for the others.
- (c) exploration: distinct completions per group of 4, reward and accuracy of the samples, steps per row.
(d) estimator noise needs gradients: `python -m dllm_ais.experimental.learning_diagnostics` measures the gradient's SNR.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import torch

from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.data import load_task_dataset, tokenize_prompts
from dllm_ais.likelihood import trajectory_logprobs
from dllm_ais.loading import load_model, load_tokenizer
from dllm_ais.metrics import distinct_completions
from dllm_ais.policy import build_policy
from dllm_ais.rewards import resolve_reward_functions, score_rollout_table
from dllm_ais.tasks import get_task

DECODERS = {  # each sets both rollout fields: the recipe's own decoder may be a fast one
    "exact": {"cache": "none", "threshold": None},
    "dual cache": {"cache": "dual", "threshold": None},
    "threshold 0.9": {"cache": "none", "threshold": 0.9},
    "dual + threshold 0.9": {"cache": "dual", "threshold": 0.9},
    "prefix + threshold 0.9": {"cache": "prefix", "threshold": 0.9}}


def kendall_distance(first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] share of completion-position pairs (i, j) inside `mask` that two commit orders [B, L] disagree on:
    ordered oppositely counts 1, a tie in exactly one of them ½."""
    def sign(order: torch.Tensor) -> torch.Tensor:
        return torch.sign(order.unsqueeze(2) - order.unsqueeze(1)).float()

    pairs = (mask.unsqueeze(2) & mask.unsqueeze(1)).triu(diagonal=1)
    disagreement = (sign(first) - sign(second)).abs() / 2
    return (disagreement * pairs).sum((1, 2)) / pairs.sum((1, 2)).clamp(min=1)


def context_size(commit_step: torch.Tensor) -> torch.Tensor:
    """[B, L] how many completion tokens were already committed when each token was (its unmasked context)."""
    return (commit_step.unsqueeze(1) < commit_step.unsqueeze(2)).sum(2).float()


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model or adapter directory (default: the recipe's model)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    overrides = ["--output_dir=/tmp/unused", "--likelihood.estimator=trajectory",
                 "--experimental.likelihood_decoder=exact"]
    config = load_config(EMBEDDED_RECIPE, overrides + ([f"--model_name_or_path={args.model}"] if args.model else []))
    tokenizer = load_tokenizer(config.model_name_or_path)
    model = load_model(config.model_name_or_path, torch.float32).eval()
    task = get_task(config.task)
    dataset = load_task_dataset(config.task, "validation", path=config.dataset_path, size=args.prompts, seed=args.seed,
                                task_args=config.task_args)
    G = config.num_generations
    columns = {name: [value for value in dataset[name] for _ in range(G)] for name in dataset.column_names}
    input_ids, attention_mask = tokenize_prompts(tokenizer, columns["prompt"], config.max_prompt_length)
    reward_funcs = resolve_reward_functions(config.task)
    in_exact_order = dataclasses.replace(config, experimental=dataclasses.replace(config.experimental,
                                                                                  likelihood_order="exact"))
    exact_order = build_policy(in_exact_order, model.config, tokenizer, temperature=1.0).exact_order_sampler
    print(f"device: cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}, float32 model "
          f"{config.model_name_or_path}; {args.prompts} validation prompts x {G} completions, temperature 1, "
          f"gen {config.max_completion_length}, block {config.rollout.block_length}, {config.rollout.steps} steps")
    print("| decoder | steps / row | (a) k3 seen by the ratio | (a) mean abs log ρ | (b) order distance to the exact "
          "replay | (b) context at commit, own / exact order | (b) log-lik per token, own / exact order | "
          "(c) distinct / group | reward | accuracy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, fields in DECODERS.items():
        policy = build_policy(dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, **fields)),
                              model.config, tokenizer, temperature=1.0)
        rollout = policy.sample(model, input_ids, attention_mask, torch.Generator().manual_seed(args.seed))
        mask = rollout.completion_mask
        replayed = trajectory_logprobs(model, rollout, model.config.mask_token_id, temperature=1.0)
        log_ratio = (replayed - rollout.step_logprobs)[mask]
        k3 = (log_ratio.exp() - log_ratio - 1).mean().item()
        exact = exact_order.replay(model, rollout)
        distance = kendall_distance(rollout.commit_step, exact.commit_step, mask).mean().item()
        own_context, exact_context = context_size(rollout.commit_step)[mask].mean(), context_size(exact.commit_step)[mask].mean()
        table = score_rollout_table(tokenizer, [*reward_funcs, task.accuracy], columns, rollout)
        reward = table.values[:, :len(reward_funcs)].nansum(1)  # the recipe weighs its reward functions equally
        distinct = distinct_completions(rollout.completion_ids, mask, G).mean().item()
        print(f"| {name} | {rollout.num_steps.float().mean():.2f} | {k3:.2e} | {log_ratio.abs().mean():.3f} | "
              f"{distance:.3f} | {own_context:.2f} / {exact_context:.2f} | {replayed[mask].mean():.3f} / "
              f"{exact.step_logprobs[mask].mean():.3f} | {distinct:.2f} | {reward.mean():.4f} | "
              f"{table.values[:, -1].mean():.4f} |", flush=True)


if __name__ == "__main__":
    main()
