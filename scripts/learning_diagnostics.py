"""Does RL learn on this recipe, and if not, why? Two measurements, on CPU in minutes.

    python scripts/learning_diagnostics.py                                   # the embedded LLaDA run
    python scripts/learning_diagnostics.py recipes/tiny_qwen3_digits_fp8_ais.yaml
    python scripts/learning_diagnostics.py --part gradient --prompts 512 --estimators one_step,trajectory \\
        --p_mask_prompt=0.15                                                 # any recipe field as --field=value

`gradient` — on ONE batch (`--prompts` × num_generations completions sampled by the recipe's policy):
  * frac_reward_zero_std: groups whose completions all score the same (they carry no gradient);
  * the gradient g of the policy-gradient surrogate Σ_i A_i Σ_t ℓ_it / N for each likelihood estimator, and the
    same with the advantages permuted across the batch (no signal, same magnitudes): the gradient's signal-to-noise
    SNR = (|g|² − mean |g_perm|²) / mean |g_perm|² (≤ 0: indistinguishable from noise at this batch size);
  * the first-order test: step the trainable weights by η · g/|g| and re-sample the same prompts with the same
    random numbers; the paired change of the expected reward (Δ ± SE) must be > 0 along g for an estimator whose
    gradient points uphill, and ≈ 0 (or < 0, from curvature) along a permuted g.
`control` — the random-reward control: the recipe trained twice from the same seed, on the task's rewards and on
  the same rewards permuted across each batch (`dllm_ais.rewards.permuted_reward`); the paired greedy held-out
  change of each. A real run must beat its control by several standard errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile

import torch

from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.evaluation import paired_difference
from dllm_ais.loss import group_advantages
from dllm_ais.rewards import permuted_reward, resolve_reward_functions, score_rollout
from dllm_ais.trainer import GRPOTrainer, build_policy, held_out_line


def flat_gradient(trainer: GRPOTrainer, policy, rollout, advantages: torch.Tensor, seed: int) -> torch.Tensor:
    """∇θ of Σ_i A_i Σ_t m_it ℓ_it / N (the surrogate's signal at θ = θ_old), micro-batch by micro-batch."""
    model, mask = trainer.unwrapped_model, rollout.completion_mask
    parameters = trainer.trainable_parameters
    model.zero_grad(set_to_none=True)
    for rows in trainer.micro_batches(len(advantages)):
        logp = policy.logprobs(model, rollout.select(rows), seed)
        objective = (torch.where(mask[rows], logp, 0.0) * advantages[rows, None]).sum() / mask.sum()
        objective.backward()
    gradient = torch.cat([p.grad.flatten() for p in parameters])
    model.zero_grad(set_to_none=True)
    return gradient


@torch.no_grad()
def expected_reward(trainer: GRPOTrainer, columns, seed: int) -> torch.Tensor:
    """Per-completion reward of a fresh sample of the batch's prompts, with a fixed sampling seed."""
    generator = torch.Generator(trainer.accelerator.device).manual_seed(seed)
    rollout = trainer.sample(trainer.policy, trainer.unwrapped_model, columns, generator)
    return score_rollout(trainer.tokenizer, trainer.reward_funcs, columns, rollout, trainer.config.reward_weights)[0]


@torch.no_grad()
def shifted(trainer: GRPOTrainer, direction: torch.Tensor, step: float):
    """Move the trainable weights by `step` along the unit vector of `direction` (in place); returns the undo."""
    parameters = trainer.trainable_parameters
    saved = [p.detach().clone() for p in parameters]
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        parameter.add_(step * direction[offset:offset + count].view_as(parameter) / direction.norm())
        offset += count

    @torch.no_grad()
    def undo():
        for parameter, value in zip(parameters, saved):
            parameter.copy_(value)
    return undo


def gradient_part(config, args) -> None:
    trainer = GRPOTrainer(dataclasses.replace(config, eval_size=0, output_dir=tempfile.mkdtemp()))
    trainer.model.eval()
    rows = trainer.train_dataset.select(range(args.prompts))
    G = config.num_generations
    columns = {column: [value for value in rows[column] for _ in range(G)] for column in rows.column_names}
    generator = torch.Generator(trainer.accelerator.device).manual_seed(config.seed)
    rollout = trainer.sample(trainer.policy, trainer.unwrapped_model, columns, generator)
    rewards, _ = score_rollout(trainer.tokenizer, trainer.reward_funcs, columns, rollout, config.reward_weights)
    advantages = group_advantages(rewards, G, config.scale_rewards)
    zero_std = (rewards.view(-1, G).std(dim=1) == 0).float().mean().item()
    print(f"batch: {args.prompts} prompts x {G}, mean reward {rewards.mean():.4f}, frac_reward_zero_std {zero_std:.3f}, "
          f"temperature {config.temperature}")
    baseline = expected_reward(trainer, columns, seed=config.seed + 1)
    permutations = torch.Generator().manual_seed(1)
    for estimator in args.estimators.split(","):
        policy = build_policy(dataclasses.replace(config, likelihood_estimator=estimator), trainer.unwrapped_model.config,
                              trainer.tokenizer)
        gradient = flat_gradient(trainer, policy, rollout, advantages, seed=config.seed)
        controls = [flat_gradient(trainer, policy, rollout, advantages[torch.randperm(len(advantages),
                                                                                       generator=permutations)],
                                  seed=config.seed) for _ in range(args.permutations)]
        noise = sum(c.square().sum() for c in controls).item() / len(controls)
        snr = (gradient.square().sum().item() - noise) / noise
        print(f"[{estimator}] |g| {gradient.norm():.4g}, mean |g_perm| {math.sqrt(noise):.4g}, gradient SNR {snr:+.3f}")
        for step in args.steps:
            for label, direction in (("g", gradient), ("g_perm", controls[0])):
                undo = shifted(trainer, direction, step)
                change = paired_difference(baseline, expected_reward(trainer, columns, seed=config.seed + 1))
                undo()
                print(f"    step {step:g} along {label:6s}: expected reward Δ {change.mean:+.4f} ± "
                      f"{change.standard_error:.4f} SE (paired over {change.num_prompts} completions)")


def control_part(config, args) -> None:
    for label, rewards in (("task rewards", None), ("permuted rewards (control)", "permuted")):
        funcs = resolve_reward_functions(config.reward_funcs or config.task)
        if rewards == "permuted":
            funcs = [permuted_reward(fn, seed=config.seed) for fn in funcs]
        trainer = GRPOTrainer(dataclasses.replace(config, max_steps=args.control_steps or config.max_steps,
                                                  output_dir=tempfile.mkdtemp()), reward_funcs=funcs)
        result = trainer.train()
        print(f"{label}: {held_out_line(result.eval_before, result.eval_after)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default=str(EMBEDDED_RECIPE))
    parser.add_argument("--part", choices=("gradient", "control", "all"), default="all")
    parser.add_argument("--prompts", type=int, default=256, help="gradient part: prompts in the batch")
    parser.add_argument("--estimators", default=None, help="gradient part: comma-separated (diffusion: one_step,"
                                                           "trajectory; default: the recipe's)")
    parser.add_argument("--permutations", type=int, default=3)
    parser.add_argument("--steps", type=lambda text: [float(v) for v in text.split(",")], default=[0.03, 0.1],
                        help="gradient part: step lengths along the unit gradient")
    parser.add_argument("--control-steps", type=int, default=None, help="control part: max_steps (default: recipe)")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    config = load_config(args.recipe, overrides)
    args.estimators = args.estimators or config.likelihood_estimator
    if args.part in ("gradient", "all"):
        gradient_part(config, args)
    if args.part in ("control", "all"):
        control_part(config, args)


if __name__ == "__main__":
    main()
