"""Why a low-precision rollout loses what bf16 rollouts learn: bias or variance, and which canvas sees the mismatch.

    python -m dllm_ais.experimental.precision_frontier_diagnosis --rollout.precision=mxfp4 --prompts 256
    python -m dllm_ais.experimental.precision_frontier_diagnosis --part mismatch --rollout.precision=mxfp4

On the recipe's initial policy (θ_old; any recipe field as --field=value), for `--replicates` independent batches
of `--prompts` × num_generations completions sampled by the bf16 trainer and by the rollout engine at the recipe's
`rollout.precision` (the same decoder, the same prompts, batch r of both sides drawn from the same sampling seed):

`mismatch` — on the engine's completions, the token log-ratio log ρ = ℓ_trainer − ℓ_engine on the two canvases the
  estimators score: the one-step canvas (every completion position masked, ℓ_rollout recomputed by the engine) and
  the trajectory's per-step canvases (ℓ_rollout = the log-prob the engine sampled each token with, ℓ_trainer = the
  bf16 replay of the same decoder); per canvas k3, token and sequence ESS, the share of Σ (log ρ)² carried by the
  top 1 % of tokens, the mean log ρ and |log ρ| by commit step (rank of the step within the row) and by completion
  position, and the correlation of the sequence log-ratio with the group advantage (a correction changes the
  expected gradient only through that covariance). Then the reward test: the engine batches' mean reward, raw and
  re-weighted by the self-normalised sequence ratio of either canvas, against the bf16 batches' — a ratio that
  holds the whole mismatch of the sampling distribution brings the engine's reward to bf16's. With confidence-ranked
  remasking (low_confidence, a threshold) which positions a step commits depends on the model too, and no token
  ratio holds that part; `--rollout.remasking=random --rollout.threshold=null --rollout.cache=none` is the control
  whose trajectory ratio is the whole ratio. With `--experimental.rollout_position_temperature=T` (T > 0) both sides
  decode with the stochastic commit rule, and the "complete" canvas adds the commit choice's log-ratio to the
  trajectory's (`DiffusionPolicy.choice_logprobs`, docs/algorithms.md "The complete ratio"), over every position.
`gradient` — the policy-gradient surrogate's gradient g = ∇ Σ_i A_i Σ_t w_it ℓ_it / N at θ_old for each estimator,
  from bf16 batches and from engine batches, unweighted and with importance weights from either canvas (token TIS,
  sequence IS, truncated at `--clip`). Per arm: reward mean and frac_reward_zero_std of its batches, gradient SNR
  against within-group permuted advantages, and the bias test: with R replicates per arm, the squared distance of
  the arm's gradients to the bf16 gradients of *other* batches against the bf16 gradients' distance to each other —
  excess = (D_cross − D_within_bf16) / D_within_bf16 ≈ 0 when the arm estimates the same expected gradient as bf16
  rollouts (what is left is variance), > 0 by the bias² relative to the noise. Then the first-order test: the
  bf16 policy's expected reward (temperature-1 samples of the recipe's decoder, and greedy exact decoding: the
  held-out protocol) after a step η along each arm's mean gradient, paired per prompt with θ_old.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from accelerate.utils import set_seed

from dllm_ais.components import build_components, make_accelerator
from dllm_ais.config import EMBEDDED_RECIPE, load_config
from dllm_ais.data import load_task_dataset
from dllm_ais.experimental.learning_diagnostics import Setup, permuted_within_groups, shifted
from dllm_ais.grpo import grouped_prompts, micro_batches
from dllm_ais.loading import load_tokenizer
from dllm_ais.loss import group_advantages
from dllm_ais.policy import build_policy, sample_prompts
from dllm_ais.rewards import resolve_reward_functions, score_rollout
from dllm_ais.sampling.diffusion.choice import recorded_choice
from dllm_ais.statistics import paired_difference


def with_estimator(config, estimator: str):
    return dataclasses.replace(config, likelihood=dataclasses.replace(config.likelihood, estimator=estimator))


@torch.no_grad()
def draw(setup: Setup, model, columns, seed: int):
    """A batch sampled by `model` with the recipe's decoder: rollout, rewards [B], advantages [B]."""
    device = setup.parts.accelerator.device
    rollout = sample_prompts(setup.parts.policy, model, setup.tokenizer, columns["prompt"],
                             setup.config.max_prompt_length, device, torch.Generator(device).manual_seed(seed),
                             setup.config.per_device_train_batch_size)
    rewards, _ = score_rollout(setup.tokenizer, setup.reward_funcs, columns, rollout, setup.config.reward_weights)
    return rollout, rewards, group_advantages(rewards, setup.config.num_generations, setup.config.scale_rewards)


@torch.no_grad()
def logprobs(setup: Setup, policy, model, rollout, seed: int, rollout_side: bool = False) -> torch.Tensor:
    score = policy.rollout_logprobs if rollout_side else policy.logprobs
    return torch.cat([score(model, rollout.select(rows), seed)
                      for rows in micro_batches(len(rollout.sequences), setup.config.per_device_train_batch_size)])


def log_ratios(setup: Setup, policies: dict, rollout, seed: int) -> dict[str, torch.Tensor]:
    """Per canvas, log ρ = ℓ_trainer − ℓ_engine [B, L] of the engine's completions (0 off the completion); with a
    trajectory policy and a rollout that records its commit choices (experimental.rollout_position_temperature > 0),
    also the complete ratio ("complete"): the trajectory's token log-ratio plus the commit choice's
    (`DiffusionPolicy.choice_logprobs` against the rollout's `CommitChoiceRecord`), over every completion position — the
    whole trajectory's probability, tokens after the first EOS included."""
    trainer, engine = setup.parts.unwrapped_model, setup.parts.engine.model
    mask = rollout.completion_mask.bool()
    token_ratios = {estimator: logprobs(setup, policy, trainer, rollout, seed)
                    - logprobs(setup, policy, engine, rollout, seed, rollout_side=True)
                    for estimator, policy in policies.items()}
    ratios = {estimator: torch.where(mask, ratio, 0.0) for estimator, ratio in token_ratios.items()}
    if "trajectory" in policies and recorded_choice(rollout) is not None:
        choice = torch.cat([policies["trajectory"].choice_logprobs(trainer, rollout.select(rows))
                            for rows in micro_batches(len(rollout.sequences), setup.config.per_device_train_batch_size)])
        ratios["complete"] = token_ratios["trajectory"] + choice - recorded_choice(rollout).logprobs
    return ratios


def truncated(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, clip: float) -> torch.Tensor:
    """Importance weights [B, L]: token min(ρ_t, clip), or sequence min(Π ρ_t, clip) on every token."""
    if level == "token":
        weights = log_ratio.exp()
    else:
        weights = (log_ratio * mask).sum(1, keepdim=True).exp().expand_as(log_ratio)
    return torch.where(mask, weights.clamp(max=clip), 0.0)


def flat_gradient(setup: Setup, policy, rollout, advantages, weights, seed: int) -> torch.Tensor:
    """∇θ Σ_i A_i Σ_t w_it ℓ_it / N at the trainer's weights (weights [B, L], or None: 1)."""
    model, mask = setup.parts.unwrapped_model, rollout.completion_mask.bool()
    model.zero_grad(set_to_none=True)
    for rows in micro_batches(len(advantages), setup.config.per_device_train_batch_size):
        logp = policy.logprobs(model, rollout.select(rows), seed)
        w = mask[rows].float() if weights is None else weights[rows]
        ((torch.where(mask[rows], logp, 0.0) * w * advantages[rows, None]).sum() / mask.sum()).backward()
    gradient = torch.cat([p.grad.flatten() for p in setup.parts.trainable_parameters])
    model.zero_grad(set_to_none=True)
    return gradient


def mismatch_report(name: str, log_ratio: torch.Tensor, rollout, advantages, group_size: int) -> None:
    mask = torch.ones_like(rollout.completion_mask.bool()) if name == "complete" else rollout.completion_mask.bool()
    values = log_ratio[mask]
    rho = values.exp()
    k3 = (rho - values - 1).mean().item()
    token_ess = (rho.sum() ** 2 / (len(rho) * rho.square().sum())).item()
    seq = (log_ratio * mask).sum(1)
    seq_rho = (seq - seq.max()).exp()
    seq_ess = (seq_rho.sum() ** 2 / (len(seq_rho) * seq_rho.square().sum())).item()
    squares = values.square().sort(descending=True).values
    top = squares[:max(1, len(squares) // 100)].sum() / squares.sum().clamp(min=1e-30)
    informative = advantages.view(-1, group_size).std(1).repeat_interleave(group_size) > 0
    corr = torch.corrcoef(torch.stack([seq[informative], advantages[informative]]))[0, 1].item()
    print(f"  [{name} canvas] {int(mask.sum())} tokens, {len(seq)} completions: k3 {k3:.3e}, mean log ρ "
          f"{values.mean():+.3e}, mean |log ρ| {values.abs().mean():.3e}, max |log ρ| {values.abs().max():.3f}, "
          f"token ESS {token_ess:.4f}, sequence ESS {seq_ess:.4f}, top-1 % tokens carry {top:.1%} of Σ(log ρ)², "
          f"mean |log ρ_seq| {seq.abs().mean():.4f}, corr(log ρ_seq, A) over informative groups {corr:+.3f} "
          f"({int(informative.sum())} completions)")
    rank = torch.zeros_like(rollout.commit_step)
    for row in range(len(rank)):  # the rank of each token's commit step among its row's steps
        steps = torch.unique(rollout.commit_step[row][mask[row]])
        rank[row] = torch.searchsorted(steps, rollout.commit_step[row].contiguous())
    for label, index in (("commit-step rank", rank), ("position", torch.arange(mask.shape[1]).expand_as(rank))):
        cells = []
        for value in torch.unique(index[mask]).tolist():
            where = mask & (index == value)
            part = log_ratio[where]
            cells.append(f"{value}: n {int(where.sum())} mean {part.mean():+.2e} |.| {part.abs().mean():.2e}")
        print(f"    by {label}: " + "; ".join(cells))


def reward_test(batches, ratios, engine_side: str, estimators: list[str], group_size: int) -> None:
    """Can the ratio see what moves the reward? Per prompt, the bf16 batches' mean reward against the engine
    batches' raw mean and their self-normalised sequence-IS estimate Σ_g ρ_g R_g / Σ_g ρ_g (ρ_g = Π_t ρ_t on each
    canvas, untruncated), each averaged over the replicates, paired over prompts. A ratio that holds the whole
    mismatch of the sampling distribution brings the estimate to bf16's (up to its variance)."""
    def per_prompt(values):  # [B] -> [prompts], the mean over a group
        return values.view(-1, group_size).mean(1)
    reference = torch.stack([per_prompt(r) for _, r, _ in batches["bf16"]]).mean(0)
    estimates = {"raw": torch.stack([per_prompt(r) for _, r, _ in batches[engine_side]]).mean(0)}
    means = {}
    for canvas in estimators:
        values, plain, weights = [], [], []
        for (rollout, rewards, _), ratio in zip(batches[engine_side], ratios):
            seq = ratio[canvas].sum(1)  # 0 off each canvas' positions
            weights.append(per_prompt(seq.exp()))
            plain.append(per_prompt(seq.exp() * rewards))
            seq = seq.view(-1, group_size)
            w = (seq - seq.max(1, keepdim=True).values).exp()
            values.append((w * rewards.view(-1, group_size)).sum(1) / w.sum(1))
        estimates[f"sequence IS ({canvas} ratio)"] = torch.stack(values).mean(0)
        estimates[f"unnormalised IS ({canvas} ratio)"] = torch.stack(plain).mean(0)
        means[canvas] = torch.stack(weights).mean(0)
    print(f"  reward test ({len(reference)} prompts, {len(batches['bf16'])} batches per side): bf16 rollouts' "
          f"mean reward {reference.mean():.4f}")
    for label, estimate in estimates.items():
        change = paired_difference(reference.tolist(), estimate.tolist())
        print(f"    {engine_side} {label:32s} {estimate.mean():.4f}, Δ vs bf16 {change.mean:+.4f} ± "
              f"{change.standard_error:.4f} (paired over prompts)")
    for canvas, values in means.items():  # E_engine[ρ_seq] = 1 when ρ_seq is the whole ratio of the two samplers
        print(f"    E_{engine_side}[ρ_seq] on the {canvas} canvas {values.mean():.4f} ± "
              f"{values.std() / math.sqrt(len(values)):.4f} (1 for a complete ratio; SE over prompts)")


@torch.no_grad()
def bf16_rewards(setup: Setup, columns, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's per-prompt mean reward of temperature-1 samples (recipe decoder, fixed seed), and its reward
    under greedy exact decoding of the same prompts (one completion per prompt)."""
    G = setup.config.num_generations
    _, rewards, _ = draw(setup, setup.parts.unwrapped_model, columns, seed)
    prompts = {key: values[::G] for key, values in columns.items()}
    device = setup.parts.accelerator.device
    greedy = sample_prompts(setup.parts.greedy_policy, setup.parts.unwrapped_model, setup.tokenizer, prompts["prompt"],
                            setup.config.max_prompt_length, device, torch.Generator(device).manual_seed(seed),
                            setup.config.per_device_train_batch_size)
    greedy_rewards, _ = score_rollout(setup.tokenizer, setup.reward_funcs, prompts, greedy, setup.config.reward_weights)
    return rewards.view(-1, G).mean(1), greedy_rewards


def parsed_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The command line: the study's options, and the config overrides left for `load_config`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default=str(EMBEDDED_RECIPE))
    parser.add_argument("--part", choices=("mismatch", "gradient", "all"), default="all")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument("--estimators", default="one_step,trajectory")
    parser.add_argument("--clip", type=float, default=2.0, help="truncation of the importance weights")
    parser.add_argument("--permutations", type=int, default=2)
    parser.add_argument("--steps", type=lambda text: [float(v) for v in text.split(",") if v], default=[0.1])
    return parser.parse_known_args()


def loaded_setup(config):
    """The config's components (the engine synced from the trainer's model, in eval mode), tokenizer and rewards,
    and its training prompts, built in a training run's order after seeding."""
    accelerator = make_accelerator(config)
    set_seed(config.seed, device_specific=True)
    tokenizer = load_tokenizer(config.model_name_or_path)
    dataset = load_task_dataset(config.task, split="train", path=config.dataset_path, size=config.dataset_size,
                                seed=config.seed, task_args=config.task_args)
    setup = Setup(config, build_components(config, tokenizer, accelerator), tokenizer,
                  resolve_reward_functions(config.reward_funcs or config.task))
    setup.parts.model.eval()
    setup.parts.engine.sync_from(setup.parts.unwrapped_model)
    return setup, dataset


def print_rollout_summary(batches: dict, G: int) -> None:
    """Per side: mean steps per row, mean reward, the share of zero-std groups and of completions identical to
    bf16's of the same seed."""
    for side, drawn in batches.items():
        zero = [(r.view(-1, G).std(1) == 0).float().mean().item() for _, r, _ in drawn]
        same = [(ro.completion_ids == ref.completion_ids).all(1).float().mean().item()
                for (ro, _, _), (ref, _, _) in zip(drawn, batches["bf16"])]
        steps = [ro.num_steps.float().mean().item() for ro, _, _ in drawn if ro.num_steps is not None]
        print(f"  {side} rollouts: mean steps per row {[round(x, 2) for x in steps]}, "
              f"mean reward {[round(r.mean().item(), 4) for _, r, _ in drawn]}, "
              f"frac_reward_zero_std {[round(z, 3) for z in zero]}, completions identical to bf16's "
              f"(same seed) {[round(s, 3) for s in same]}")


def gradient_directions(setup: Setup, args: argparse.Namespace, policies: dict, batches: dict, ratios: list,
                        replicates: int) -> dict:
    """Per estimator and arm (bf16, the engine uncorrected, token / sequence IS on each canvas's ratio): the
    gradients at θ_old of each batch, printed against the bf16 batches' (norm, SNR, cosine, excess distance); returns
    each arm's mean gradient."""
    config, G = setup.config, setup.config.num_generations
    engine_side = config.rollout.precision
    permutations = torch.Generator().manual_seed(1)
    directions = {}
    for estimator, policy in policies.items():
        arms = {"bf16": [(b, None) for b in batches["bf16"]],
                f"{engine_side} uncorrected": [(b, None) for b in batches[engine_side]]}
        for canvas in ratios[0]:
            for level in ("token", "sequence"):
                arms[f"{engine_side} {level} IS ({canvas} ratio)"] = [
                    (b, truncated(ratio[canvas], b[0].completion_mask.bool(), level, args.clip))
                    for b, ratio in zip(batches[engine_side], ratios)]
        gradients = {arm: [flat_gradient(setup, policy, rollout, advantages, weights, config.seed)
                           for (rollout, _, advantages), weights in runs] for arm, runs in arms.items()}
        reference = gradients["bf16"]
        pairs = [(i, j) for i in range(replicates) for j in range(replicates) if i != j]
        within = sum((reference[i] - reference[j]).square().sum().item() for i, j in pairs) / len(pairs)
        print(f"[{estimator} estimator] gradients at θ_old; D_within(bf16) {within:.4e}")
        for arm, grads in gradients.items():
            cross = sum((grads[i] - reference[j]).square().sum().item() for i, j in pairs) / len(pairs)
            cosine = sum(torch.nn.functional.cosine_similarity(grads[i], reference[j], dim=0).item()
                         for i, j in pairs) / len(pairs)
            (rollout, _, advantages), weights = arms[arm][0]
            noise = sum(flat_gradient(setup, policy, rollout, permuted_within_groups(advantages, G, permutations),
                                      weights, config.seed).square().sum().item()
                        for _ in range(args.permutations)) / args.permutations
            snr = (grads[0].square().sum().item() - noise) / noise
            print(f"  {arm:38s} |g| {sum(g.norm().item() for g in grads) / len(grads):.4e}  SNR(batch 0) {snr:+.3f}  "
                  f"cos to other bf16 batches {cosine:+.3f}  excess (D_cross − D_within)/D_within "
                  f"{(cross - within) / within:+.3f}")
            directions[(estimator, arm)] = torch.stack(grads).mean(0)
    return directions


def first_order_test(setup: Setup, columns, directions: dict, steps: list[float], prompts: int) -> None:
    """The bf16 policy's sampled and greedy rewards after a step along each arm's mean gradient, paired against
    θ_old's on the same prompts."""
    evaluation_seed = setup.config.seed + 77
    base_sampled, base_greedy = bf16_rewards(setup, columns, evaluation_seed)
    print(f"first-order test on the bf16 policy ({prompts} prompts; θ_old: temperature-1 reward "
          f"{base_sampled.mean():.4f}, greedy exact reward {base_greedy.mean():.4f}):")
    for (estimator, arm), direction in directions.items():
        for step in steps:
            undo = shifted(setup, direction, step)
            sampled, greedy = bf16_rewards(setup, columns, evaluation_seed)
            undo()
            a, b = paired_difference(base_sampled, sampled), paired_difference(base_greedy, greedy)
            print(f"  [{estimator}] {arm:38s} step {step:g}: sampled Δ {a.mean:+.4f} ± {a.standard_error:.4f}, "
                  f"greedy exact Δ {b.mean:+.4f} ± {b.standard_error:.4f}")


def main() -> None:
    args, overrides = parsed_arguments()
    torch.set_num_threads(1)
    config = load_config(args.recipe, overrides)
    setup, dataset = loaded_setup(config)
    G, estimators = config.num_generations, args.estimators.split(",")
    policies = {e: build_policy(with_estimator(config, e), setup.parts.unwrapped_model.config, setup.tokenizer)
                for e in estimators}
    columns = grouped_prompts(dataset.select(range(args.prompts)), G)
    seeds = [config.seed + 1000 * (r + 1) for r in range(args.replicates)]
    start = time.perf_counter()
    batches = {side: [draw(setup, model, columns, s) for s in seeds]
               for side, model in (("bf16", setup.parts.unwrapped_model),
                                   (config.rollout.precision, setup.parts.engine.model))}
    print(f"{args.prompts} prompts x {G}, {args.replicates} batches per side, rollout.precision "
          f"{config.rollout.precision}, estimators {estimators}, decoder cache {config.rollout.cache} threshold "
          f"{config.rollout.threshold} ({time.perf_counter() - start:.0f} s sampling)")
    print_rollout_summary(batches, G)
    engine_side = config.rollout.precision
    ratios = [log_ratios(setup, policies, rollout, config.seed) for rollout, _, _ in batches[engine_side]]
    if args.part in ("mismatch", "all"):
        print(f"mismatch of the {engine_side} engine's completions (batch 0; log ρ = ℓ_trainer − ℓ_engine):")
        rollout, _, advantages = batches[engine_side][0]
        canvases = list(ratios[0])
        for canvas in canvases:
            mismatch_report(canvas, ratios[0][canvas], rollout, advantages, G)
        reward_test(batches, ratios, engine_side, canvases, G)
    if args.part == "mismatch":
        return
    directions = gradient_directions(setup, args, policies, batches, ratios, len(seeds))
    if args.steps:
        first_order_test(setup, columns, directions, args.steps, args.prompts)


if __name__ == "__main__":
    main()
