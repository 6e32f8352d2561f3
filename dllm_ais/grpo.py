"""One GRPO step as plain functions: a generation batch, then `num_iterations` optimisation passes over it.

`make_generation_batch` (per device: `per_device_train_batch_size × gradient_accumulation_steps` completions):

1. sync the rollout engine (FP8 copy of the policy) from the trainer, in place;
2. sample G completions per prompt with the engine (the decoder of each group: `dllm_ais.fidelity`);
3. score them with the reward functions; group advantages over the batch gathered from every process; with
   `drop_zero_std_groups`, keep the groups whose rewards differ (`groups_to_update`) for the stages below;
4. log-probs with one estimator on both sides, per estimator seed: ℓ_rollout (engine), ℓ_old (trainer, no grad;
   with `bypass_mode`, verl's, or an engine sharing the trainer's model and forward — the unified precision flow —
   ℓ_old = ℓ_rollout and no pass), ℓ_ref (adapter disabled, if β > 0), at the positions
   the estimate scores (`Policy.scored_positions`);
5. correction weights (AIS by default) from ℓ_old vs ℓ_rollout over those positions.

`optimisation_pass`: the clipped GRPO loss × weights over the batch's micro-batches, one optimizer step; within a
micro-batch, one backward per forward of the estimator (`backward_by_pieces`). With `bypass_mode` the first pass over
a batch, still at θ_old, also measures the mismatch of ℓ_θ against ℓ_rollout (`bypass_diagnostics`).

Both take their collaborators (`StepComponents`, the tokenizer, reward functions, the correction) as arguments, so
benchmarks and tests run a step without a trainer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from dllm_ais.components import StepComponents
from dllm_ais.config import GRPOConfig
from dllm_ais.correction import RolloutCorrection
from dllm_ais.fidelity import RolloutFidelity, exact_share_metrics
from dllm_ais.likelihood import LogprobPiece, sum_pieces, whole_piece
from dllm_ais.loss import TokenLoss, group_advantages, zero_std_groups
from dllm_ais.metrics import completion_metrics, distinct_completions, ends_with_eos, reward_metrics
from dllm_ais.ops import masked_mean
from dllm_ais.sampling.diffusion.choice import recorded_choice
from dllm_ais.sampling.diffusion.editing import recorded_edits
from dllm_ais.policy import sample_prompts, scores_rollout_by_forward
from dllm_ais.rewards import NonFiniteRewardError, RewardTable, completion_texts, score_rollout_table
from dllm_ais.sampling.rollout import Rollout


@dataclass
class GenerationBatch:
    """Everything the loss needs from one generation batch, computed once before the μ optimisation passes.

    `metrics["num_tokens"]` counts the tokens seen by the run up to this batch, all processes together;
    `completion_samples` (not checkpointed) are the samples `log_completions` logs, on the main process."""

    rollout: Rollout
    advantages: torch.Tensor  # [B]
    logp_old: list[torch.Tensor]  # per estimator seed: [B, L]
    logp_ref: list[torch.Tensor | None]
    weights: list[torch.Tensor]
    clip_scale: list[torch.Tensor | None]
    diagnostics: list[dict[str, float]]
    seeds: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    completion_samples: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: a checkpoint keeps the batch a run is in the middle of."""
        state = dataclasses.asdict(dataclasses.replace(self, completion_samples=None))
        del state["completion_samples"]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device) -> "GenerationBatch":
        def to_device(values):
            return [None if v is None else v.to(device) for v in values]

        return cls(Rollout(**state["rollout"]).to(device), state["advantages"].to(device), to_device(state["logp_old"]),
                   to_device(state["logp_ref"]), to_device(state["weights"]), to_device(state["clip_scale"]),
                   state["diagnostics"], state["seeds"], state["metrics"])


SKIP_HINTS = {
    "reward": "check the reward functions (return a finite float, or None to exclude a completion)",
    "loss": "try a lower learning_rate or max_grad_norm",
    "gradient": "try a lower learning_rate or max_grad_norm",
}
ROUTING_METRIC = "routing/trainer_engine_differs"  # experimental.routing_replay: docs/algorithms.md, MoE routing
LOGPROB_HINT = "NaN/inf log-probs usually mean an overflow in low precision: try dtype=float32 or rollout.precision=bf16"


class SkippedBatch(Exception):
    """A NaN or inf at `stage` (reward, a log-prob, the loss or the gradient): the generation batch is dropped before
    any optimizer step, so the weights and the optimizer state stay untouched."""

    def __init__(self, stage: str, detail: str = ""):
        self.stage = stage
        super().__init__(f"non-finite {stage}" + (f": {detail}" if detail else ""))

    @property
    def hint(self) -> str:
        """What usually fixes a run that keeps skipping at this stage."""
        return SKIP_HINTS.get(self.stage, LOGPROB_HINT)


def grouped_prompts(rows, num_generations: int) -> dict[str, list]:
    """The columns of the dataset `rows` with every row repeated `num_generations` times: one GRPO group per
    prompt, the input of `make_generation_batch`."""
    return {column: [value for value in rows[column] for _ in range(num_generations)] for column in rows.column_names}


def micro_seed(seed: int, micro_batch: int) -> int:
    """The estimator seed of one micro-batch: distinct across micro-batches and across inner iterations' seeds."""
    return seed + 100_003 * micro_batch


def micro_batches(size: int, micro_batch_size: int) -> list[slice]:
    """The row slices of a batch of `size` rows, `micro_batch_size` at a time."""
    return [slice(start, start + micro_batch_size) for start in range(0, size, micro_batch_size)]


def estimator_seeds(config: GRPOConfig, num_seeds: int, generation_index: int, process_index: int) -> list[int]:
    """The generation batch's estimator seeds: one per inner iteration (one-step surrogate) or a single one."""
    base = config.seed * 1_000_003 + generation_index * 1_009 + process_index * 7_919_001
    return [base + n for n in range(num_seeds)]


def groups_to_update(rewards: torch.Tensor, num_generations: int, num_processes: int) -> torch.Tensor:
    """[P·B] bool: the completions `drop_zero_std_groups` keeps for the log-probs and the update, from the rewards
    [P·B] gathered from P processes (B each, whole groups of G = num_generations): every group whose rewards differ
    (not `zero_std_groups`), and on each process as many of its zero-std groups, first ones first, as bring its
    kept groups to the most any process keeps (at least one). Every process then keeps the same number of rows,
    hence runs the same micro-batches and backwards (DDP's collectives), and a batch with nothing to learn still
    takes its optimizer step; a kept zero-std group's advantages are 0, its tokens add nothing to the gradient."""
    zero = zero_std_groups(rewards, num_generations).view(num_processes, -1)
    informative = (~zero).sum(dim=1, keepdim=True)
    kept_per_process = informative.max().clamp(min=1)
    keep = ~zero | (zero.cumsum(dim=1) <= kept_per_process - informative)
    return keep.flatten().repeat_interleave(num_generations)


def any_process(accelerator: Accelerator, *flags: bool) -> list[bool]:
    """Each flag OR-ed over all processes (one gather), so that every process takes the same branch."""
    local = torch.tensor([[float(flag) for flag in flags]], device=accelerator.device)
    if accelerator.num_processes > 1:
        local = accelerator.gather(local)
    return [bool(value) for value in local.amax(0).tolist()]


def non_finite_reward_problem(accelerator: Accelerator, problem: str, table: RewardTable | None) -> str:
    """What made a batch's rewards, or the float32 arithmetic on them (weighted sums, group means, advantages), NaN
    or inf, the same on every process: a reward function's own unusable value (`problem`, a NonFiniteRewardError's
    message) on any process, else the value of largest magnitude over every process' `table`, with its function."""
    local = (2, 0.0, problem)  # (rank of the explanation, magnitude, explanation): the greatest is told
    if not problem and table is not None and (largest := table.largest()) is not None:
        name, value = largest
        local = (1, abs(value), f"reward function '{name}' returned {value:g}, and the rewards' float32 arithmetic "
                 "(weighted sum, group mean, advantages) overflows; return rewards of a smaller magnitude")
    return max(gather_object([local]) if accelerator.num_processes > 1 else [local])[2]


def non_finite(tensors: list[torch.Tensor | None], mask: torch.Tensor) -> bool:
    """Whether any [B, L] tensor holds NaN or inf at a completion position (padding is never read)."""
    return any(t is not None and not torch.isfinite(t.detach()[mask]).all() for t in tensors)


def micro_batched_logprobs(score: Callable, model, rollout: Rollout, seed: int, micro_batch_size: int,
                           advantages: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, L] by `score` (a policy's `logprobs` or `rollout_logprobs`), micro-batch by micro-batch,
    micro-batch j with estimator seed `micro_seed(seed, j)` and its rows' `advantages` [B].

    ℓ_θ is computed per micro-batch during the optimisation passes; computing ℓ_rollout, ℓ_old and ℓ_ref over the
    very same slices with the very same seeds gives every side identical random masks.
    """
    return torch.cat([score(model, rollout.select(rows), micro_seed(seed, j), advantages=advantages[rows])
                      for j, rows in enumerate(micro_batches(len(rollout.sequences), micro_batch_size))])


def micro_batched_positions(policy, rollout: Rollout, seed: int, micro_batch_size: int) -> torch.Tensor:
    """The positions [B, L] bool the estimate with `seed` scores (`Policy.scored_positions`), drawn micro-batch by
    micro-batch with `micro_seed`, as `micro_batched_logprobs` scores them."""
    return torch.cat([policy.scored_positions(rollout.select(rows), micro_seed(seed, j))
                      for j, rows in enumerate(micro_batches(len(rollout.sequences), micro_batch_size))])


@torch.no_grad()
def reference_logprobs(parts: StepComponents, rollout: Rollout, seed: int, micro_batch_size: int,
                       advantages: torch.Tensor) -> torch.Tensor:
    """ℓ_ref: the reference model's log-probs, or the trainer's with its LoRA adapter disabled."""
    if parts.reference_model is not None:
        return micro_batched_logprobs(parts.policy.logprobs, parts.reference_model, rollout, seed, micro_batch_size,
                                      advantages)
    with parts.unwrapped_model.disable_adapter():
        return micro_batched_logprobs(parts.policy.logprobs, parts.model, rollout, seed, micro_batch_size, advantages)


def old_is_rollout(config: GRPOConfig, parts: StepComponents, rollout: Rollout) -> bool:
    """Whether ℓ_old is taken to be ℓ_rollout, with no pass of its own: bypass mode (verl's, by choice), or an engine
    that shares the trainer's model (the unified precision flow) when ℓ_rollout is the very forward ℓ_old would run
    (`scores_rollout_by_forward`), so they are equal by construction."""
    return config.correction.bypass_mode or (parts.engine.shares_trainer_model
                                             and scores_rollout_by_forward(parts.policy, rollout))


def sample_records(columns: dict[str, list], rollout: Rollout, tokenizer, table: RewardTable, rewards: torch.Tensor,
                   advantages: torch.Tensor, count: int) -> list[dict[str, Any]]:
    """`count` of this process' completions, for `log_completions`: the prompt (its last message), the completion,
    the reward, each reward function's value and the advantage."""
    rows = slice(0, count)
    prompts = [p[-1]["content"] if isinstance(p, list) else str(p) for p in columns["prompt"][rows]]
    texts = completion_texts(tokenizer, rollout.select(rows))
    values = table.values[rows].tolist()
    return [{"prompt": prompt, "completion": text, "reward": reward, "advantage": advantage,
             **{f"rewards/{name}": value for name, value in zip(table.names, row)}}
            for prompt, text, reward, advantage, row in zip(prompts, texts, rewards[rows].tolist(),
                                                            advantages[rows].tolist(), values)]


@dataclass
class _Scored:
    """A sampled batch's rewards: this process' rewards [B] and each reward function's metrics; every process'
    rewards and group advantages, their statistics, and the reward table (None when a reward was not finite)."""

    rewards: torch.Tensor
    per_function_metrics: dict[str, float]
    all_rewards: torch.Tensor
    all_advantages: torch.Tensor
    statistics: dict[str, float]
    table: RewardTable | None


def _sample(config: GRPOConfig, parts: StepComponents, tokenizer, columns: dict[str, list], generation_index: int,
            policies: list, timings: dict[str, float]) -> Rollout:
    """The engine's rollout of `columns["prompt"]`, prompt i by `policies[i]`, with the generation's own seed;
    its seconds go into `timings`."""
    accelerator = parts.accelerator
    generator = torch.Generator(accelerator.device).manual_seed(
        config.seed + 7919 * generation_index + 104_729 * accelerator.process_index
        + 1_000_003 * config.experimental.rollout_seed_offset)
    start = time.perf_counter()
    rollout = sample_prompts(policies, parts.engine.model, tokenizer, columns["prompt"], config.max_prompt_length,
                             accelerator.device, generator, config.rollout.batch_size, parts.engine.forwards)
    timings["timing/sample_s"] = time.perf_counter() - start
    return rollout


def _score(config: GRPOConfig, parts: StepComponents, tokenizer, reward_funcs: list[Callable],
           columns: dict[str, list], rollout: Rollout) -> _Scored:
    """The rollout's rewards and group advantages over every process; SkippedBatch when one is not finite."""
    accelerator = parts.accelerator
    problem, table = "", None
    try:
        table = score_rollout_table(tokenizer, reward_funcs, columns, rollout)
        rewards, per_function_metrics = table.weighted_sum(config.reward_weights), table.metrics()
    except NonFiniteRewardError as error:
        rewards, per_function_metrics, problem = torch.full((len(rollout.sequences),), math.nan), {}, str(error)
    all_rewards = accelerator.gather(rewards.to(accelerator.device))
    all_advantages = group_advantages(all_rewards, config.num_generations, config.scale_rewards)
    statistics = reward_metrics(all_rewards, config.num_generations)
    if not (torch.isfinite(all_advantages).all() and all(map(math.isfinite, statistics.values()))):
        raise SkippedBatch("reward", non_finite_reward_problem(accelerator, problem, table))
    return _Scored(rewards, per_function_metrics, all_rewards, all_advantages, statistics, table)


def _rollout_metrics(config: GRPOConfig, parts: StepComponents, rollout: Rollout, scored: _Scored) -> dict[str, float]:
    """The batch's reward statistics, completion lengths and endings, distinct completions per group, mean
    denoising steps and, with token editing, mean edits per completion, over every process."""
    gather = parts.accelerator.gather
    lengths = gather(rollout.completion_mask.sum(1))
    terminated = gather(ends_with_eos(rollout.completion_ids, parts.policy.sampler_config.eos_token_ids).long())
    distinct = distinct_completions(rollout.completion_ids, rollout.completion_mask, config.num_generations)
    edits = recorded_edits(rollout)
    return {
        **scored.statistics, **completion_metrics(lengths, terminated),
        "completions/distinct_per_group": gather(distinct.to(parts.accelerator.device)).mean().item(),
        **({} if rollout.num_steps is None else {"completions/mean_steps": rollout.num_steps.float().mean().item()}),
        **({} if edits is None else {"completions/mean_edits": gather(edits.counts(rollout.completion_mask)).float()
                                     .mean().item()}),
    }



def _logprobs(config: GRPOConfig, parts: StepComponents, rollout: Rollout, seeds: list[int],
              advantages: torch.Tensor) -> tuple[list, list, torch.Tensor | None, list]:
    """(ℓ_rollout, ℓ_old, the trainer's commit-choice log-probs or None, ℓ_ref) per estimator seed, no gradients;
    SkippedBatch when one is not finite at a completion position."""
    micro_batch_size = config.per_device_train_batch_size
    parts.model.eval()
    with torch.no_grad(), parts.routing_replay():
        logp_rollout = [micro_batched_logprobs(parts.policy.rollout_logprobs, parts.engine.model, rollout, s,
                                               micro_batch_size, advantages) for s in seeds]
        logp_old = logp_rollout if old_is_rollout(config, parts, rollout) else [
            micro_batched_logprobs(parts.policy.logprobs, parts.model, rollout, s, micro_batch_size, advantages)
            for s in seeds]
        trainer_choice = config.experimental.complete_ratio or (config.experimental.commit_choice_gradient
                                                              and not config.correction.bypass_mode)
        choice_old = None if not trainer_choice else micro_batched_logprobs(
            parts.policy.choice_logprobs, parts.model, rollout, seeds[0], micro_batch_size, advantages)
    logp_ref = [None if config.beta == 0 else reference_logprobs(parts, rollout, s, micro_batch_size, advantages)
                for s in seeds]
    logprobs = {"rollout log-probs": logp_rollout + [recorded_choice_logprobs(rollout)], "old log-probs": logp_old + [choice_old],
                "reference log-probs": logp_ref}
    bad = any_process(parts.accelerator,
                      *(non_finite(values, rollout.completion_mask) for values in logprobs.values()))
    if any(bad):
        raise SkippedBatch(next(stage for stage, flag in zip(logprobs, bad) if flag))
    return logp_rollout, logp_old, choice_old, logp_ref


def recorded_choice_logprobs(rollout: Rollout) -> torch.Tensor | None:
    """The rollout's recorded commit-choice log-probs [B, L] (the complete ratio's sampler side), None without."""
    record = recorded_choice(rollout)
    return None if record is None else record.logprobs


def make_generation_batch(config: GRPOConfig, parts: StepComponents, tokenizer, reward_funcs: list[Callable],
                          columns: dict[str, list], generation_index: int, correction: RolloutCorrection,
                          tokens_seen: int = 0, fidelity: RolloutFidelity | None = None) -> GenerationBatch:
    """Sample `columns["prompt"]` (whole groups of G) with the engine, score them, and compute log-probs and
    correction weights; `tokens_seen` is the run's token count before this batch.

    `fidelity` says which decoder samples each group (the current rung of adaptive fidelity, the exact decoder for
    the `rollout_exact_fraction` share) and advances on this batch's diagnostics; None = a fresh one from the
    config (rung 0: the configured decoder).

    The batch's metrics (rewards, lengths) are those of every sampled completion; with `drop_zero_std_groups` its
    rollout, advantages, log-probs and weights are those of the kept groups.

    Raises SkippedBatch (on every process alike) when a reward or a log-prob is NaN or inf.
    """
    accelerator, gather, rank = parts.accelerator, parts.accelerator.gather, parts.accelerator.process_index
    timings = {"timing/sync_s": parts.engine.sync_from(parts.unwrapped_model)}
    fidelity = fidelity or RolloutFidelity.from_config(config, parts.policy)
    fidelity_metrics = fidelity.metrics()
    seeds = estimator_seeds(config, parts.policy.num_estimator_seeds(config.num_iterations), generation_index, rank)
    num_exact = fidelity.exact_prompts(len(columns["prompt"]), config.num_generations, seeds[0])
    rollout = _sample(config, parts, tokenizer, columns, generation_index,
                      fidelity.prompt_policies(len(columns["prompt"]), num_exact), timings)
    tokens = rollout.attention_mask[:, :rollout.prompt_length].sum() + rollout.completion_mask.sum()
    tokens_seen += int(gather(tokens.reshape(1)).sum())

    scored = _score(config, parts, tokenizer, reward_funcs, columns, rollout)
    local = slice(rank * len(scored.rewards), (rank + 1) * len(scored.rewards))
    all_advantages = scored.all_advantages
    advantages = all_advantages[local]
    rollout_metrics = _rollout_metrics(config, parts, rollout, scored)
    samples = None
    if config.log_completions and accelerator.is_main_process:
        samples = sample_records(columns, rollout, tokenizer, scored.table, scored.rewards, advantages,
                                 config.num_completions_to_print)
    if config.drop_zero_std_groups:
        keep = groups_to_update(scored.all_rewards, config.num_generations, accelerator.num_processes)
        rollout, advantages, all_advantages = rollout.select(keep[local]), advantages[keep[local]], all_advantages[keep]
        local = slice(rank * len(advantages), (rank + 1) * len(advantages))

    start = time.perf_counter()
    logp_rollout, logp_old, choice_old, logp_ref = _logprobs(config, parts, rollout, seeds, advantages)
    timings["timing/logprob_s"] = time.perf_counter() - start

    start = time.perf_counter()
    # Weights and diagnostics (ESS, α, ...) are computed over the whole batch, gathered from every process, at the
    # positions each estimate scores.
    scored_positions = [gather(micro_batched_positions(parts.policy, rollout, s, config.per_device_train_batch_size)
                               .long()).bool() for s in seeds]
    choice_pair = None if choice_old is None else (gather(choice_old), gather(recorded_choice_logprobs(rollout)))
    corrections = correction([(gather(old), gather(ro)) for old, ro in zip(logp_old, logp_rollout)],
                             all_advantages, scored_positions, choice_pair)
    timings["timing/correction_s"] = time.perf_counter() - start
    fidelity.update([c.diagnostics for c in corrections])
    if config.experimental.rollout_exact_fraction > 0:
        decoded_exactly = torch.arange(len(scored.rewards), device=accelerator.device) < num_exact
        fidelity_metrics.update(exact_share_metrics(gather(decoded_exactly), scored.all_rewards))

    metrics = {**rollout_metrics, "num_tokens": float(tokens_seen), **fidelity_metrics,
               **scored.per_function_metrics, **timings}
    if config.experimental.commit_choice_gradient:  # the loss's log-probs hold the commit choice too (DiffusionPolicy)
        choice = recorded_choice_logprobs(rollout) if choice_old is None else choice_old
        logp_old = [old + choice for old in logp_old]
    return GenerationBatch(rollout, advantages, logp_old, logp_ref, [c.weights[local] for c in corrections],
                           [None if c.clip_scale is None else c.clip_scale[local] for c in corrections],
                           [c.diagnostics for c in corrections], seeds, metrics, samples)


@dataclass
class MicroBatchPass:
    """What one micro-batch's forwards and backwards leave: the loss (detached, the sum of its pieces'), the
    metrics' sums (`TokenLoss`), the log-probs ℓ_θ [B, L] (detached), the entropy [B, L] when asked for, and whether
    every log-prob at a completion position and every piece's loss were finite."""

    loss: torch.Tensor
    metric_sums: dict[str, torch.Tensor]
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    finite_logprobs: torch.Tensor
    finite_loss: torch.Tensor


def pieces_align_across_processes(config: GRPOConfig) -> bool:
    """Whether every process' micro-batch yields the same number of estimator forwards, so that a backward per
    forward (each one a gradient all-reduce or reduce-scatter under DDP / FSDP) keeps the processes in step: the
    commit steps come from the fixed schedule (no parallel decoding, or the exact-order replay), whose steps are the
    same for every row, or the decoder replay (`GRPOConfig.replays_decoder`) gives one piece per block. With parallel
    decoding a process may commit at fewer distinct steps than another, and each micro-batch then takes a single
    backward."""
    return (config.experimental.likelihood_order == "exact" or config.replays_decoder
            or (config.rollout.threshold is None and config.experimental.rollout_factor is None))


def backward_by_pieces(pieces: Iterable[LogprobPiece], objective: TokenLoss, completion_mask: torch.Tensor,
                       backward: Callable[[torch.Tensor], None], compute_entropy: bool,
                       piecewise: bool = True) -> MicroBatchPass:
    """Run the micro-batch's loss and backward piece by piece: for each `LogprobPiece` (one forward of the
    estimator, run when the iterator is asked for it), `backward(Σ_{t ∈ piece} c_t · L_t)` before the next forward,
    so the autograd graph holds one forward at a time; the gradients add up to those of the loss at once, since
    each token's loss term depends on its own log-prob only (`TokenLoss`). The pieces are summed first, for one
    backward, with `piecewise=False` (DeepSpeed: one backward per micro-step) or when the objective cannot take
    pieces (`TokenLoss.takes_pieces`: the ctpo ratio, whose prefix needs every token).
    """
    if not (piecewise and objective.takes_pieces):
        pieces = [whole_piece(sum_pieces(pieces, compute_entropy), compute_entropy)]
    loss, sums, logprobs, entropy, finite_logprobs, finite_loss = 0.0, {}, 0.0, None, [], []
    for piece in pieces:
        piece_loss, piece_sums = objective(piece.logprobs, piece.positions)
        # Non-finite or not, every piece is backpropagated (every process joins the all-reduce); the caller decides.
        backward(piece_loss)
        loss = loss + piece_loss.detach()
        logprobs = logprobs + piece.logprobs.detach()
        sums = {name: sums.get(name, 0.0) + value for name, value in piece_sums.items()}
        if compute_entropy:
            entropy = piece.entropy if entropy is None else entropy + piece.entropy
        finite_logprobs.append(torch.isfinite(piece.logprobs.detach()[piece.positions & completion_mask]).all())
        finite_loss.append(torch.isfinite(piece_loss.detach()))
    return MicroBatchPass(loss, sums, logprobs, entropy, torch.stack(finite_logprobs).all(),
                          torch.stack(finite_loss).all())


def bypass_diagnostics(correction: RolloutCorrection, accelerator: Accelerator, logp_theta: torch.Tensor,
                       logp_rollout: torch.Tensor, scored: torch.Tensor) -> dict[str, float]:
    """Bypass mode's mismatch diagnostics (`RolloutCorrection.first_update_diagnostics`) over every process: ℓ_θ
    [B, L] of a batch's first update (in train mode, so with any dropout) against ℓ_rollout [B, L], over the `scored`
    positions: with one estimator seed per iteration (the one-step surrogate), those of the first seed's masks, the
    only ones scored at θ_old."""
    gather = accelerator.gather
    return correction.first_update_diagnostics(gather(logp_theta), gather(logp_rollout), gather(scored.long()).bool())


def optimisation_pass(config: GRPOConfig, parts: StepComponents, batch: GenerationBatch, iteration: int,
                      correction: RolloutCorrection) -> dict[str, float]:
    """One optimizer step over the generation batch: gradient accumulation over its micro-batches, and within a
    micro-batch over the estimator's forwards (`backward_by_pieces`: a trajectory-type estimator's peak memory is
    one forward's, whatever the number of denoising steps).

    accelerate divides each micro-batch loss by gradient_accumulation_steps; `dapo` already normalises by the
    token count of the whole generation batch (averaged over processes), so its loss is scaled back up.
    The step is taken only when the policy log-probs, the loss and the gradient norm are finite on every
    process; otherwise the gradients are dropped and SkippedBatch raised before `optimizer.step` (which would
    move AdamW's moments and, through weight decay, the weights even for a zero gradient).
    """
    accelerator, model, optimizer = parts.accelerator, parts.model, parts.optimizer
    k = iteration % len(batch.seeds)
    model.train()
    scored = micro_batched_positions(parts.policy, batch.rollout, batch.seeds[k], config.per_device_train_batch_size)
    local_tokens = scored.sum().float()
    total_tokens = accelerator.gather(local_tokens.reshape(1)).mean().clamp(min=1).item()
    rows_of = micro_batches(len(batch.advantages), config.per_device_train_batch_size)
    ctpo_options = config.experimental.ctpo_loss_options()
    scale = len(rows_of) if config.loss_type == "dapo" else 1
    # DeepSpeed takes one backward per micro-step; several processes need the same number of backwards (collectives),
    # which a sharded (FSDP2) model's estimators see to: its forwards are agreed across the processes.
    piecewise = accelerator.distributed_type != DistributedType.DEEPSPEED and (
        accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.FSDP
        or pieces_align_across_processes(config))
    summed: dict[str, float] = dict(batch.diagnostics[k])
    first_pass = iteration == 0  # the policy's entropy on the batch: once, at θ_old (a full-vocabulary pass)
    losses, entropies, finite, logp_theta = [], [], [], []
    for j, rows in enumerate(rows_of):
        with accelerator.accumulate(model), parts.routing_replay() as routing:
            part = batch.rollout.select(rows)
            objective = TokenLoss(
                batch.logp_old[k][rows], batch.advantages[rows], scored[rows],
                weights=batch.weights[k][rows],
                clip_scale=None if batch.clip_scale[k] is None else batch.clip_scale[k][rows],
                logp_ref=None if batch.logp_ref[k] is None else batch.logp_ref[k][rows],
                beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                loss_type=config.loss_type, max_completion_length=config.max_completion_length,
                num_items_in_batch=total_tokens, ratio_type=config.experimental.ratio_type, **ctpo_options)
            pieces = parts.policy.logprob_pieces(model, part, micro_seed(batch.seeds[k], j), compute_entropy=first_pass,
                                                  advantages=batch.advantages[rows])
            done = backward_by_pieces(pieces, objective, part.completion_mask,
                                      lambda loss: accelerator.backward(loss * scale), first_pass, piecewise)
        losses.append(done.loss * scale)
        logp_theta.append(done.logprobs)
        finite.append(torch.stack([done.finite_logprobs, done.finite_loss]))
        if done.entropy is not None:
            entropies.append(masked_mean(done.entropy, scored[rows]))
        micro_metrics = objective.metrics(done.metric_sums)
        if routing is not None:  # experimental.routing_replay: how often the trainer's own routing was overridden
            micro_metrics[ROUTING_METRIC] = routing.own_differs_share()
        for key, value in micro_metrics.items():
            summed[key] = summed.get(key, 0.0) + value / len(rows_of)
    summed["loss"] = torch.stack(losses).mean().item()
    if entropies:  # logged with every pass of this batch
        summed["entropy"] = batch.metrics["entropy"] = torch.stack(entropies).mean().item()
    bad_logprobs, bad_loss = (not flag for flag in torch.stack(finite).all(dim=0).tolist())
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    bad_logprobs, bad_loss = any_process(accelerator, bad_logprobs, bad_loss)
    # DeepSpeed clips inside its engine and reports no norm: there only the log-prob and loss checks apply.
    bad_gradient = grad_norm is not None and not torch.isfinite(torch.as_tensor(grad_norm)).item()
    if bad_logprobs or bad_loss or bad_gradient:
        optimizer.zero_grad(set_to_none=True)
        raise SkippedBatch("policy log-probs" if bad_logprobs else "loss" if bad_loss else "gradient",
                           f"grad norm {float(grad_norm)}" if bad_gradient else "")
    if config.correction.bypass_mode and first_pass:  # the batch's mismatch, logged with every pass of it
        batch.diagnostics[:] = [bypass_diagnostics(correction, accelerator, torch.cat(logp_theta), batch.logp_old[k],
                                                   scored)] * len(batch.seeds)
        summed.update(batch.diagnostics[k])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    return {**summed, "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
            "learning_rate": parts.scheduler.get_last_lr()[0]}
