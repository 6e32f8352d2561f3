"""The diffusion estimators a config can name (`likelihood.estimator`, choices.ESTIMATORS): `DIFFUSION_ESTIMATORS`,
each a `DiffusionEstimator` whose adapter scores a `Rollout` with the `EstimatorSettings`, and the positions an
estimate scores (`scored_positions`, a `BlockSubset`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from dllm_ais.likelihood.bounds import (
    BoundSettings,
    MaskDraw,
    _scored_draws,
    block_mask_draws,
    elbo_from_draws,
    eubo_from_draws,
    random_mask_draws,
    sandwiched_log_likelihood,
    spread_over_tokens,
)
from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    LogitsFn,
    _check_canvas,
    _check_mask_token,
    is_plain_int,
    mask_generator,
    plain_logits,
)
from dllm_ais.likelihood.one_step import one_step_logprobs
from dllm_ais.likelihood.trajectory import (
    ChoiceReplayFn,
    DecoderLogitsFn,
    LogprobPiece,
    decoder_trajectory_pieces,
    merges_no_steps,
    step_merge_pieces,
    sum_pieces,
    trajectory_pieces,
    whole_piece,
)
from dllm_ais.rollout import Rollout


@dataclass(frozen=True)
class BlockSubset:
    """The trajectory-type estimators scoring a random share of the completion's blocks per estimate (config
    `likelihood_block_fraction`, `block_length`): k = max(1, round(fraction · n)) of the n = ⌈L / block_length⌉
    blocks, drawn uniformly without replacement from `mask_generator(seed)` among the blocks that hold a valid token
    of some row (topped up with empty ones when fewer do), the same blocks for every row.

    A block's tokens are committed by its own steps only (semi-autoregressive decoding), so scoring k blocks takes
    the forwards of their steps alone — about k/n of the trajectory's, and always k blocks' worth, so that every
    process runs as many forwards. Every valid token is scored with the same probability, so the loss over the scored
    tokens, normalised by their count, estimates the loss over all of them (a ratio estimate, as TRL's DDPO trains on
    a `train_timestep_fraction` of the denoising steps); drawing among the blocks that hold valid tokens spends no
    update on a block of end-of-text padding."""

    fraction: float
    block_length: int

    def __post_init__(self):
        if not (0 < self.fraction <= 1):
            raise ValueError(f"likelihood_block_fraction must be in (0, 1]; got {self.fraction!r}")
        if not is_plain_int(self.block_length) or self.block_length < 1:
            raise ValueError(f"block_length must be a positive int; got {self.block_length!r}")

    def positions(self, completion_mask: Tensor, seed: int) -> Tensor:
        """The completion positions [L] bool of the blocks drawn with `seed`, given the valid tokens [B, L]."""
        gen_length = completion_mask.shape[1]
        num_blocks = math.ceil(gen_length / self.block_length)
        padded = torch.zeros(num_blocks * self.block_length, dtype=torch.bool)
        padded[:gen_length] = completion_mask.bool().any(dim=0).cpu()
        holds_valid = padded.view(num_blocks, self.block_length).any(dim=1)
        order = torch.randperm(num_blocks, generator=mask_generator(seed))
        order = order[torch.argsort((~holds_valid[order]).int(), stable=True)]  # blocks with valid tokens first
        in_block = torch.zeros(num_blocks, dtype=torch.bool)
        in_block[order[:max(1, round(self.fraction * num_blocks))]] = True
        return in_block.repeat_interleave(self.block_length)[:gen_length]


@dataclass(frozen=True)
class EstimatorSettings:
    """What a diffusion estimator needs besides the model, the rollout and the seed: the mask id, the sampling
    temperature (the trajectory-type estimators score softmax(logits / τ)), d1's prompt-masking probability
    (one-step surrogate and the bounds), `logits_fn`, the sampler's canvas → logits stage (see `LogitsFn`), the
    bound estimators' `BoundSettings`, StepMerge's number of segments N, the decoder replay's `decoder_logits` (and
    `decoder_choice_replay`, which adds the commit choice's log-prob to its positions), and the trajectory-type
    estimators' `BlockSubset` (None: every block)."""

    mask_token_id: int
    temperature: float
    p_mask_prompt: float = 0.15
    logits_fn: LogitsFn = plain_logits
    bounds: BoundSettings = field(default_factory=BoundSettings)
    likelihood_segments: int = 16
    decoder_logits: DecoderLogitsFn | None = None
    decoder_choice_replay: ChoiceReplayFn | None = None
    block_subset: BlockSubset | None = None


def _one_step_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                         compute_entropy: bool, advantages: Tensor | None = None):
    return one_step_logprobs(model, rollout.sequences, rollout.attention_mask, rollout.prompt_length,
                             settings.mask_token_id, seed, p_mask_prompt=settings.p_mask_prompt,
                             compute_entropy=compute_entropy, logits_fn=settings.logits_fn)


def _drawn_positions(settings: EstimatorSettings, rollout: Rollout, seed: int) -> Tensor | None:
    """Every position [B, L] of the blocks a trajectory-type estimate draws, padding included (so that every process
    runs the same forwards, whatever its completions' lengths); None when it scores every block."""
    if settings.block_subset is None:
        return None
    drawn = settings.block_subset.positions(rollout.completion_mask, seed).to(rollout.completion_ids.device)
    return drawn.expand_as(rollout.completion_ids)


def scored_positions(settings: EstimatorSettings, rollout: Rollout, seed: int) -> Tensor:
    """The completion tokens [B, L] bool an estimate with `seed` scores: the valid ones (`completion_mask`), those of
    the drawn blocks alone with a `BlockSubset`."""
    valid = rollout.completion_mask.bool()
    drawn = _drawn_positions(settings, rollout, seed)
    return valid if drawn is None else valid & drawn


def _trajectory_pieces_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                                  compute_entropy: bool, advantages: Tensor | None = None) -> Iterator[LogprobPiece]:
    positions = _drawn_positions(settings, rollout, seed)
    if settings.decoder_logits is not None:
        return decoder_trajectory_pieces(model, rollout, settings.decoder_logits, settings.temperature,
                                         compute_entropy=compute_entropy, positions=positions,
                                         choice_replay=settings.decoder_choice_replay)
    return trajectory_pieces(model, rollout, settings.mask_token_id, settings.temperature,
                             compute_entropy=compute_entropy, logits_fn=settings.logits_fn, positions=positions)


def _step_merge_pieces_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                                  compute_entropy: bool, advantages: Tensor | None = None) -> Iterator[LogprobPiece]:
    return step_merge_pieces(model, rollout, settings.mask_token_id, settings.temperature,
                             settings.likelihood_segments, compute_entropy=compute_entropy,
                             logits_fn=settings.logits_fn, positions=_drawn_positions(settings, rollout, seed))


def _draws_blocks(settings: EstimatorSettings) -> bool:
    return settings.block_subset is not None


def _step_merge_is_the_trajectory(settings: EstimatorSettings, rollout: Rollout) -> bool:
    return merges_no_steps(rollout.commit_step, settings.likelihood_segments)


def _bound_draws(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int, block_wise: bool,
                 compute_entropy: bool) -> tuple[list[MaskDraw], list[Tensor], Tensor | None]:
    """The draws of one bound estimate of `rollout` (block-wise or LLaDA's random masks, from `mask_generator(seed)`),
    the log-probs [B, L] of each, and with `compute_entropy` the mean entropy over every draw's masked valid tokens,
    one value per sequence spread to its valid tokens (the sequence-level estimate's entropy)."""
    _check_mask_token(model, settings.mask_token_id)
    attention_mask = _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    bounds = settings.bounds
    if not is_plain_int(bounds.num_samples) or bounds.num_samples < 1:
        raise ValueError(f"elbo_samples must be a positive int (Monte-Carlo draws); got {bounds.num_samples!r}")
    generator = mask_generator(seed)
    if block_wise:
        draws = block_mask_draws(rollout.completion_mask, bounds.block_length, bounds.num_samples, generator)
    else:
        draws = random_mask_draws(len(rollout.sequences), rollout.gen_length, bounds.num_samples, generator,
                                  bounds.coupled)
    scored = _scored_draws(model, rollout.sequences, attention_mask, rollout.prompt_length, settings.mask_token_id,
                           draws, generator, settings.p_mask_prompt, DEFAULT_CHUNK_ROWS, compute_entropy,
                           settings.logits_fn)
    if not compute_entropy:
        return draws, scored, None
    valid = rollout.completion_mask.bool()
    kept = torch.stack([draw.masked.to(valid.device) & valid for draw in draws])  # [n, B, L]
    entropies = torch.stack([entropy for _, entropy in scored])
    per_sequence = torch.where(kept, entropies, 0.0).sum(dim=(0, 2)) / kept.sum(dim=(0, 2)).clamp(min=1)
    return draws, [logprobs for logprobs, _ in scored], torch.where(valid, per_sequence.unsqueeze(1), 0.0)


def _per_token_result(sequence_values: Tensor, rollout: Rollout, entropy: Tensor | None):
    values = spread_over_tokens(sequence_values, rollout.completion_mask)
    return values if entropy is None else (values, entropy)


def _elbo_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                     compute_entropy: bool, advantages: Tensor | None = None):
    """`mc_elbo` of the valid completion tokens (random masks, coupled if set), as per-token values
    (`spread_over_tokens`)."""
    draws, logprobs, entropy = _bound_draws(model, rollout, settings, seed, False, compute_entropy)
    return _per_token_result(elbo_from_draws(logprobs, draws, rollout.completion_mask), rollout, entropy)


def _spg_of_rollout(model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                    compute_entropy: bool, advantages: Tensor | None = None):
    """`sandwiched_log_likelihood` of the ELBO and EUBO from the same draws (block-wise if set), as per-token
    values (`spread_over_tokens`); needs each sequence's advantage."""
    if advantages is None:
        raise ValueError("likelihood.estimator=spg picks each sequence's bound by the sign of its advantage: "
                         "pass advantages (one per sequence)")
    bounds = settings.bounds
    draws, logprobs, entropy = _bound_draws(model, rollout, settings, seed, bounds.block_masking, compute_entropy)
    elbo = elbo_from_draws(logprobs, draws, rollout.completion_mask)
    eubo = eubo_from_draws(logprobs, draws, bounds.eubo_beta, rollout.completion_mask)
    return _per_token_result(sandwiched_log_likelihood(elbo, eubo, advantages, bounds.mix_weight), rollout, entropy)


@dataclass(frozen=True)
class DiffusionEstimator:
    """How a masked-diffusion policy scores a rollout.

    `logprobs(model, rollout, settings, seed, compute_entropy, advantages)` gives the per-token log-probs [B, L] (and
    entropies with `compute_entropy`), `settings` an `EstimatorSettings`, `advantages` [B] the sequences' advantages
    (None where unknown; only `spg` reads them); `recorded_by_sampler`: the rollout side is the sampler's recorded
    per-step log-prob, no engine forward — True, or a predicate of (settings, rollout) when that holds for some
    settings only; `fresh_masks_per_iteration`: the estimator is random and draws new masks for every inner
    iteration (one estimator seed each), True or a predicate of the settings (the trajectory-type estimators with a
    `BlockSubset`); `pieces` (same arguments): the log-probs forward by forward, an iterator of `LogprobPiece` whose
    sum is `logprobs` (see `piecewise`), None for a single-forward estimator. An estimate is read at the positions
    `scored_positions` names (the correction and the loss run over those); a block subset holds 0 outside its blocks.

    Sequence-level estimators (`elbo`, `spg`, choices.SEQUENCE_ESTIMATORS) estimate one number per completion, v,
    and return it spread over its |o| valid tokens, v / |o| each (`spread_over_tokens`): the per-token values sum to
    v, and every token-level stage downstream then works at the sequence level by itself — the token ratio
    exp(ℓ^θ_t − ℓ^old_t) is the same at every token of a sequence, GSPO's length-normalised sequence ratio
    exp((v^θ − v^old) / |o|), clipped at 1 ± ε once per sequence in effect; token-level (and geometric) IS weights
    are that ratio between trainer and engine, is_level=sequence the full exp(v^old − v^ro)."""

    logprobs: Callable
    recorded_by_sampler: bool | Callable[[EstimatorSettings, Rollout], bool] = False
    fresh_masks_per_iteration: bool | Callable[[EstimatorSettings], bool] = False
    pieces: Callable[..., Iterable[LogprobPiece]] | None = None

    @classmethod
    def piecewise(cls, pieces: Callable[..., Iterable[LogprobPiece]], **flags) -> "DiffusionEstimator":
        """The estimator whose log-probs are the sum of `pieces`."""
        def logprobs(model, rollout, settings, seed, compute_entropy, advantages=None):
            return sum_pieces(pieces(model, rollout, settings, seed, compute_entropy, advantages), compute_entropy)

        return cls(logprobs, pieces=pieces, **flags)

    def logprob_pieces(self, model: nn.Module, rollout: Rollout, settings: EstimatorSettings, seed: int,
                       compute_entropy: bool, advantages: Tensor | None = None) -> Iterable[LogprobPiece]:
        """The log-probs as pieces, one per forward: `pieces`, or a single piece over every position."""
        if self.pieces is None:
            return [whole_piece(self.logprobs(model, rollout, settings, seed, compute_entropy, advantages),
                                compute_entropy)]
        return self.pieces(model, rollout, settings, seed, compute_entropy, advantages)

    def records_rollout_side(self, settings: EstimatorSettings, rollout: Rollout) -> bool:
        """Whether the rollout side of `rollout` is the sampler's recorded `step_logprobs`."""
        recorded = self.recorded_by_sampler
        return recorded(settings, rollout) if callable(recorded) else recorded

    def draws_per_iteration(self, settings: EstimatorSettings) -> bool:
        """Whether each inner iteration draws its own estimate (masks, or blocks), one estimator seed each."""
        fresh = self.fresh_masks_per_iteration
        return fresh(settings) if callable(fresh) else fresh


DIFFUSION_ESTIMATORS = {
    "one_step": DiffusionEstimator(_one_step_of_rollout, fresh_masks_per_iteration=True),
    "trajectory": DiffusionEstimator.piecewise(_trajectory_pieces_of_rollout, recorded_by_sampler=True,
                                               fresh_masks_per_iteration=_draws_blocks),
    "step_merge": DiffusionEstimator.piecewise(_step_merge_pieces_of_rollout,
                                               recorded_by_sampler=_step_merge_is_the_trajectory,
                                               fresh_masks_per_iteration=_draws_blocks),
    "elbo": DiffusionEstimator(_elbo_of_rollout, fresh_masks_per_iteration=True),
    "spg": DiffusionEstimator(_spg_of_rollout, fresh_masks_per_iteration=True),
}
