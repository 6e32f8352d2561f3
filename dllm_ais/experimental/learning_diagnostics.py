"""Does RL learn on this recipe, and if not, why? Two measurements, on CPU in minutes.

    python -m dllm_ais.experimental.learning_diagnostics                                   # the embedded LLaDA run
    python -m dllm_ais.experimental.learning_diagnostics recipes/tiny_qwen3_digits_fp8_ais.yaml
    python -m dllm_ais.experimental.learning_diagnostics --part gradient --prompts 512 --estimators one_step,trajectory \\
        --p_mask_prompt=0.15                                                 # any recipe field as --field=value
    python -m dllm_ais.experimental.learning_diagnostics --part gradient --estimators all  # every diffusion estimator

`gradient` — on ONE batch (`--prompts` × num_generations completions sampled by the recipe's policy):
  * frac_reward_zero_std: groups whose completions all score the same (they carry no gradient);
  * the gradient g of the policy-gradient surrogate Σ_i A_i Σ_t ℓ_it / N for each likelihood estimator, and the
    same with the advantages permuted within each group (no signal, same magnitudes, each group's advantages
    still summing to 0): the gradient's signal-to-noise SNR = (|g|² − mean |g_perm|²) / mean |g_perm|²
    (≤ 0: indistinguishable from noise at this batch size);
  * the trainer-side cost of each estimator: model forwards and seconds of one ℓ_θ + backward over the batch;
  * the first-order test: step the trainable weights by η · g/|g| and re-sample the same prompts with the same
    random numbers; the change of the expected reward (Δ ± SE, paired per prompt over its completions' mean)
    must be > 0 along g for an estimator whose gradient points uphill, and ≈ 0 (or < 0, from curvature) along a
    permuted g.
`control` — the random-reward control: the recipe trained twice from the same seed, on the task's rewards and on
  the same rewards permuted across each batch (`dllm_ais.rewards.permuted_reward`; both evaluated with the task's
  own rewards); the paired greedy held-out change of each, and the paired difference of their final held-out
  rewards. A real run must beat its control by several standard errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from accelerate.utils import set_seed

from dllm_ais.choices import ESTIMATORS
from dllm_ais.components import StepComponents, build_components, make_accelerator
from dllm_ais.config import EMBEDDED_RECIPE, GRPOConfig, load_config
from dllm_ais.data import load_task_dataset
from dllm_ais.evaluation import held_out_line
from dllm_ais.statistics import paired_difference
from dllm_ais.grpo import grouped_prompts, micro_batches
from dllm_ais.loading import load_tokenizer
from dllm_ais.loss import group_advantages
from dllm_ais.policy import build_policy, sample_prompts
from dllm_ais.rewards import permuted_reward, resolve_reward_functions, score_rollout


@dataclass
class Setup:
    """The recipe's policy, model and rewards, as a training run would build them."""

    config: GRPOConfig
    parts: StepComponents
    tokenizer: Any
    reward_funcs: list


def flat_gradient(setup: Setup, policy, rollout, advantages: torch.Tensor, seed: int,
                  scoring_advantages: torch.Tensor | None = None) -> torch.Tensor:
    """∇θ of Σ_i A_i Σ_t m_it ℓ_it / N (the surrogate's signal at θ = θ_old), micro-batch by micro-batch.
    `scoring_advantages` (default `advantages`) are those the estimator scores by (SPG picks a bound by their sign)."""
    model, mask = setup.parts.unwrapped_model, rollout.completion_mask
    parameters = setup.parts.trainable_parameters
    scoring_advantages = advantages if scoring_advantages is None else scoring_advantages
    model.zero_grad(set_to_none=True)
    for rows in micro_batches(len(advantages), setup.config.per_device_train_batch_size):
        logp = policy.logprobs(model, rollout.select(rows), seed, advantages=scoring_advantages[rows])
        objective = (torch.where(mask[rows], logp, 0.0) * advantages[rows, None]).sum() / mask.sum()
        objective.backward()
    gradient = torch.cat([p.grad.flatten() for p in parameters])
    model.zero_grad(set_to_none=True)
    return gradient


def permuted_within_groups(advantages: torch.Tensor, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """The advantages shuffled inside each group of `group_size` consecutive completions (a no-signal control)."""
    groups = advantages.view(-1, group_size)
    order = torch.rand(groups.shape, generator=generator).argsort(dim=1)
    return groups.gather(1, order).flatten()


def sample(setup: Setup, columns, seed: int):
    """The policy's completions of the batch's prompts with a fixed sampling seed, in training micro-batches."""
    device = setup.parts.accelerator.device
    return sample_prompts(setup.parts.policy, setup.parts.unwrapped_model, setup.tokenizer, columns["prompt"],
                          setup.config.max_prompt_length, device, torch.Generator(device).manual_seed(seed),
                          setup.config.per_device_train_batch_size)


@torch.no_grad()
def expected_reward(setup: Setup, columns, seed: int) -> torch.Tensor:
    """Per-prompt mean reward of a fresh sample of the batch's completions, with a fixed sampling seed."""
    rollout = sample(setup, columns, seed)
    rewards = score_rollout(setup.tokenizer, setup.reward_funcs, columns, rollout, setup.config.reward_weights)[0]
    return rewards.view(-1, setup.config.num_generations).mean(dim=1)


@torch.no_grad()
def shifted(setup: Setup, direction: torch.Tensor, step: float):
    """Move the trainable weights by `step` along the unit vector of `direction` (in place); returns the undo."""
    parameters = setup.parts.trainable_parameters
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
    accelerator = make_accelerator(config)  # before set_seed, which reads the process index from it
    set_seed(config.seed, device_specific=True)
    reward_funcs = resolve_reward_functions(config.reward_funcs or config.task)
    dataset = load_task_dataset(config.task, split="train", path=config.dataset_path, size=config.dataset_size,
                                seed=config.seed, task_args=config.task_args)
    tokenizer = load_tokenizer(config.model_name_or_path)
    setup = Setup(config, build_components(config, tokenizer, accelerator), tokenizer, reward_funcs)
    setup.parts.model.eval()
    G = config.num_generations
    columns = grouped_prompts(dataset.select(range(args.prompts)), G)
    rollout = sample(setup, columns, config.seed)
    rewards, _ = score_rollout(tokenizer, setup.reward_funcs, columns, rollout, config.reward_weights)
    advantages = group_advantages(rewards, G, config.scale_rewards)
    zero_std = (rewards.view(-1, G).std(dim=1) == 0).float().mean().item()
    print(f"batch: {args.prompts} prompts x {G}, mean reward {rewards.mean():.4f}, frac_reward_zero_std {zero_std:.3f}, "
          f"temperature {config.temperature}")
    if zero_std == 1.0:
        print("every group's completions score alike: the batch carries no gradient; raise --prompts")
        return
    baseline = expected_reward(setup, columns, seed=config.seed + 1)
    permutations = torch.Generator().manual_seed(1)
    forwards = [0]
    setup.parts.unwrapped_model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    estimators = ESTIMATORS if args.estimators == "all" else args.estimators.split(",")
    for estimator in estimators:
        policy = build_policy(dataclasses.replace(config, likelihood=dataclasses.replace(config.likelihood,
                                                                                           estimator=estimator)),
                              setup.parts.unwrapped_model.config, tokenizer)
        forwards[0], start = 0, time.perf_counter()
        gradient = flat_gradient(setup, policy, rollout, advantages, seed=config.seed)
        seconds, cost = time.perf_counter() - start, forwards[0]
        # The controls keep each completion's scoring (its bound, for SPG) and permute the advantages it is weighted by.
        controls = [flat_gradient(setup, policy, rollout, permuted_within_groups(advantages, G, permutations),
                                  seed=config.seed, scoring_advantages=advantages) for _ in range(args.permutations)]
        noise = sum(c.square().sum() for c in controls).item() / len(controls)
        snr = (gradient.square().sum().item() - noise) / noise
        print(f"[{estimator}] |g| {gradient.norm():.4g}, mean |g_perm| {math.sqrt(noise):.4g}, gradient SNR {snr:+.3f}; "
              f"trainer-side cost of ℓ_θ + backward: {cost} forwards, {seconds:.1f} s (one thread)")
        for step in args.steps:
            for label, direction in (("g", gradient), ("g_perm", controls[0])):
                undo = shifted(setup, direction, step)
                change = paired_difference(baseline, expected_reward(setup, columns, seed=config.seed + 1))
                undo()
                print(f"    step {step:g} along {label:6s}: expected reward Δ {change.mean:+.4f} ± "
                      f"{change.standard_error:.4f} SE (paired over {change.num_prompts} prompts)")


def control_part(config, args) -> None:
    from dllm_ais.trainer import GRPOTrainer  # this part trains two runs

    task_rewards = resolve_reward_functions(config.reward_funcs or config.task)
    results = {}
    for label, funcs in (("task rewards", task_rewards),
                         ("permuted rewards (control)", [permuted_reward(fn, seed=config.seed) for fn in task_rewards])):
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = GRPOTrainer(dataclasses.replace(config, max_steps=args.control_steps or config.max_steps,
                                                      output_dir=output_dir),
                                  reward_funcs=funcs, eval_reward_funcs=task_rewards)
            results[label] = trainer.train()
        print(f"{label}: {held_out_line(results[label].eval_before, results[label].eval_after)}")
    real, control = results.values()
    beats = paired_difference(control.eval_after.per_prompt_reward, real.eval_after.per_prompt_reward)
    print(f"real - control, final held-out reward: {beats.mean:+.4f} ± {beats.standard_error:.4f} SE "
          f"({beats.mean / max(beats.standard_error, 1e-12):+.1f} SE, paired over {beats.num_prompts} prompts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default=str(EMBEDDED_RECIPE))
    parser.add_argument("--part", choices=("gradient", "control", "all"), default="all")
    parser.add_argument("--prompts", type=int, default=256, help="gradient part: prompts in the batch")
    parser.add_argument("--estimators", default=None, help="gradient part: comma-separated, or all (diffusion: "
                                                           f"{', '.join(ESTIMATORS)}; default: the recipe's)")
    parser.add_argument("--permutations", type=int, default=3)
    parser.add_argument("--steps", type=lambda text: [float(v) for v in text.split(",") if v], default=[0.03, 0.1],
                        help="gradient part: step lengths along the unit gradient ('' skips the first-order test)")
    parser.add_argument("--control-steps", type=int, default=None, help="control part: max_steps (default: recipe)")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    config = load_config(args.recipe, overrides)
    args.estimators = args.estimators or config.likelihood.estimator
    if args.part in ("gradient", "all"):
        gradient_part(config, args)
    if args.part in ("control", "all"):
        control_part(config, args)


if __name__ == "__main__":
    main()
