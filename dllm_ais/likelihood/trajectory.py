"""Trajectory replay: the exact log-prob of a recorded denoising trajectory (by the exact model, or by the rollout's
cached decoder itself), and d2's StepMerge, its steps merged into N segments.

These trajectory-type estimators (`choices.TRAJECTORY_ESTIMATORS`) come forward by forward (`trajectory_pieces`,
`step_merge_pieces`, `decoder_trajectory_pieces`): each `LogprobPiece` scores the tokens of one forward, so the
optimisation pass can backpropagate it before the next forward runs and the peak memory does not grow with the
number of steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import groupby
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    LogitsFn,
    _check_canvas,
    _check_mask_token,
    _scatter_to_positions,
    check_sampling_parameters,
    is_plain_int,
    noisy_canvas_logits,
    plain_logits,
    selective_log_softmax,
    shape_logits,
)
from dllm_ais.models.families import is_block_causal
from dllm_ais.models.sdar import block_size_of, canvas_blocks
from dllm_ais.models.sharding import agreed_across_processes, is_sharded
from dllm_ais.rollout import Rollout


@dataclass(frozen=True)
class LogprobPiece:
    """What one forward of a piecewise estimator scores: `positions` [B, L] bool, the completion tokens it scores;
    `logprobs` [B, L] float32, their log-probs there and 0 elsewhere; `entropy` [B, L] (detached, 0 elsewhere) when
    asked for. An estimator's log-probs are the sum of its pieces, and every completion token is in exactly one."""

    positions: Tensor
    logprobs: Tensor
    entropy: Tensor | None = None


def whole_piece(scored: Tensor | tuple[Tensor, Tensor], compute_entropy: bool) -> LogprobPiece:
    """One piece covering every completion position, from an estimator's output (log-probs, or with
    `compute_entropy` the pair (log-probs, entropies))."""
    logprobs, entropy = scored if compute_entropy else (scored, None)
    return LogprobPiece(torch.ones_like(logprobs, dtype=torch.bool), logprobs, entropy)


def sum_pieces(pieces: Iterable[LogprobPiece], compute_entropy: bool) -> Tensor | tuple[Tensor, Tensor]:
    """The log-probs [B, L] (and with `compute_entropy` the entropies) the pieces add up to."""
    logprobs = entropy = 0
    for piece in pieces:
        logprobs = logprobs + piece.logprobs
        if compute_entropy:
            entropy = entropy + piece.entropy
    return (logprobs, entropy) if compute_entropy else logprobs


def _check_commit_steps(rollout: Rollout) -> None:
    """Raise ValueError unless `rollout.commit_step` is [B, L] and names the step of every completion token."""
    commit_step = rollout.commit_step
    if commit_step.shape != rollout.completion_ids.shape:
        raise ValueError(
            f"rollout.commit_step must be [B, L] = {tuple(rollout.completion_ids.shape)}; "
            f"got {tuple(commit_step.shape)}"
        )
    if bool((commit_step < 0).any()):
        raise ValueError(
            "rollout.commit_step has negative entries (positions never committed); the trajectory-type estimators "
            "need the step of every completion token — use a rollout from a sampler that records it."
        )


def _check_staged_scoring(model: nn.Module, rollout: Rollout, mask_token_id: int, temperature: float,
                          stages_per_forward: int, name: str) -> None:
    """The argument checks of the trajectory-type estimators (`name`: what their stages_per_forward is called),
    raised before any forward."""
    _check_mask_token(model, mask_token_id)
    check_sampling_parameters(temperature, top_k=0, top_p=1.0)
    if not is_plain_int(stages_per_forward) or stages_per_forward < 1:
        raise ValueError(f"{name} must be a positive int; got {stages_per_forward!r}")
    _check_commit_steps(rollout)
    _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)


def _staged_pieces(model: nn.Module, rollout: Rollout, stage: Tensor, mask_token_id: int, temperature: float,
                   stages_per_forward: int, chunk_size: int, compute_entropy: bool,
                   logits_fn: LogitsFn, positions: Tensor | None = None) -> Iterator[LogprobPiece]:
    """The shared core of the trajectory-type estimators: the completion scored stage by stage.

    `stage` [B, L] ≥ 0 says at which stage each completion token is scored, monotone in its commit step within a
    row (within a block, for a block-causal family). For each distinct stage s the canvas is `rollout.sequences` with
    every completion position of stage ≥ s reset to the mask id, and the tokens of stage s get
    ℓ = log softmax(f(canvas_s) / τ)[token] (τ = 0: plain softmax; f: `noisy_canvas_logits`). One piece per
    forward, `stages_per_forward` canvases stacked along the batch; each forward computes logits only at the columns
    its stages score. Lazy: a forward runs when its piece is asked for. `positions` [B, L] bool (None: all) restricts
    the scoring to those tokens: a stage none of them is in takes no forward.

    A model sharded by FSDP2 (`is_sharded`) runs on every process as many forwards as the process that needs the
    most (`agreed_across_processes`): each forward gathers its weights on every process at once, in the backward too.
    A process's extra forwards score nothing (a piece without positions, still in the graph: its backward runs).
    """
    completion = rollout.completion_ids
    attention_mask = _check_canvas(rollout.sequences, rollout.attention_mask, rollout.prompt_length)
    scale = partial(shape_logits, temperature=temperature)
    batch = completion.shape[0]
    wanted = torch.ones_like(completion, dtype=torch.bool) if positions is None else positions.bool()
    forwards = list(torch.unique(stage[wanted]).split(stages_per_forward))
    if is_sharded(model):
        most = int(agreed_across_processes(torch.tensor([len(forwards)], device=stage.device))[0])
        forwards += [stage.new_full((1,), -1)] * (most - len(forwards))  # stage −1: every position masked, none scored
    for stages in forwards:
        stage_index = stages.view(-1, 1, 1)  # [S, 1, 1]
        hidden = stage.unsqueeze(0) >= stage_index  # [S, B, L]: still masked at the stage's canvas
        scored = (stage.unsqueeze(0) == stage_index) & wanted  # [S, B, L]: scored at this stage
        columns = scored.any(dim=1).any(dim=0).nonzero().flatten()  # [C] the positions these stages score
        if columns.numel() == 0:  # an extra forward of a sharded model: the logits of one position, none scored
            columns = columns.new_zeros(1)
        canvases = torch.cat(
            [rollout.prompt_ids.expand(len(stages), -1, -1), torch.where(hidden, mask_token_id, completion)], dim=2
        )
        logits = noisy_canvas_logits(model, canvases.flatten(0, 1), completion.repeat(len(stages), 1),
                                     attention_mask.repeat(len(stages), 1), columns + rollout.prompt_length,
                                     logits_fn).unflatten(0, (len(stages), batch))  # [S, B, C, V]
        kept = scored[..., columns]
        targets = completion[:, columns].expand(len(stages), -1, -1)
        values = selective_log_softmax(logits[kept], targets[kept], chunk_size, process_logits=scale,
                                       compute_entropy=compute_entropy)
        logprobs, entropy = values if compute_entropy else (values, None)
        yield LogprobPiece(
            scored.any(dim=0),
            _scatter_to_positions(scored, logprobs).sum(dim=0),
            None if entropy is None else _scatter_to_positions(scored, entropy).sum(dim=0),
        )


def block_step_ranks(commit_step: Tensor, blocks: Tensor) -> Tensor:
    """Each completion token's commit step numbered among the distinct steps of its own block (0, 1, ...), [B, L],
    given the block of each position `blocks` [B, L] (non-decreasing along a row): the round in which a block-causal
    replay scores it, round r holding the r-th step of every block.

    Raise ValueError unless every row commits its blocks one after another — every token after every token of the
    blocks before it, as SDAR's sampler decodes — since the replay scores each block against the clean blocks before
    it, which is the canvas the sampler saw only then."""
    length = commit_step.shape[1]
    starts_block = torch.ones_like(commit_step, dtype=torch.bool)
    starts_block[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
    index = torch.arange(length, device=commit_step.device).expand_as(commit_step)
    block_start = torch.where(starts_block, index, 0).cummax(dim=1).values  # [B, L]: where each token's block starts
    latest = commit_step.cummax(dim=1).values
    latest_before_block = torch.where(block_start > 0, latest.gather(1, (block_start - 1).clamp_min(0)), -1)
    if bool((commit_step <= latest_before_block).any()):
        raise ValueError("rollout.commit_step commits a token of a block before the blocks ahead of it are done: "
                         "a block-causal (SDAR) trajectory replay needs block-by-block decoding on the model's blocks "
                         "(config.block_size positions from each row's first real token), as SDAR's sampler does.")
    rank, _ = _row_step_ranks(commit_step)
    segment = starts_block.long().cumsum(dim=1) - 1  # [B, L]: the row's block number of each token
    first_rank = torch.full_like(rank, length).scatter_reduce(1, segment, rank, "amin")
    return rank - first_rank.gather(1, segment)


def trajectory_stages(model: nn.Module, rollout: Rollout) -> Tensor:
    """The stage [B, L] at which the trajectory replay scores each completion token: its commit step; for a
    block-causal family (SDAR) its step's rank within its block (`block_step_ranks`), so that one forward scores a
    step of every block, each against the clean blocks before it."""
    if not is_block_causal(model):
        return rollout.commit_step
    blocks = canvas_blocks(rollout.attention_mask, rollout.sequences.shape[1], block_size_of(model),
                           rollout.sequences.device)
    return block_step_ranks(rollout.commit_step, blocks[:, rollout.prompt_length:].expand_as(rollout.commit_step))


def trajectory_pieces(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    steps_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
    positions: Tensor | None = None,
) -> Iterator[LogprobPiece]:
    """`trajectory_logprobs` forward by forward: one `LogprobPiece` per forward (the tokens committed at its steps),
    computed when asked for, so that a caller can backpropagate each piece before the next forward runs; only the
    tokens at `positions` [B, L] (None: all), and only the steps that commit one of them. Arguments are checked at
    the call, before any forward."""
    _check_staged_scoring(model, rollout, mask_token_id, temperature, steps_per_forward, "steps_per_forward")
    return _staged_pieces(model, rollout, trajectory_stages(model, rollout), mask_token_id, temperature,
                          steps_per_forward, chunk_size, compute_entropy, logits_fn, positions)


def trajectory_logprobs(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    steps_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact log-prob of the recorded denoising trajectory, token by token: [B, L] float32.

    For each distinct step t of `rollout.commit_step`, the canvas before t is `rollout.sequences` with
    every completion position whose commit_step ≥ t reset to the mask id; the tokens committed at t get
    ℓ = log softmax(f(canvas_t) / τ)[token] at their positions (τ = 0: plain softmax) — the quantity a
    masked-diffusion sampler records in `rollout.step_logprobs`, which is therefore this estimator's
    rollout-side value. Samplers that alter the logits further (classifier-free guidance, EOS
    suppression) record their altered distribution; this replay scores what `logits_fn` returns: the
    plain model by default, the sampler's processing with its `MaskedDiffusionSampler.scoring_logits`.

    Cost: one forward per distinct step, `steps_per_forward` canvases stacked along the batch per
    forward (memory grows linearly with it; the result does not depend on it). A block-causal family (SDAR,
    decoded block by block) replays in rounds instead (`trajectory_stages`): round r is one training-mode forward
    holding the r-th step of every block, each block against the clean blocks before it — the canvas its sampler
    saw with its exact cache — so as many forwards as the most steps one block took. Each forward computes
    logits only at the completion positions committed at its steps (one position per step in
    autoregressive order), not over the whole completion. Under grad, every forward stays in the graph
    until the backward; `trajectory_pieces` hands them out one at a time instead.

    With `compute_entropy`, also returns the entropy [B, L] of the distribution each token was scored under (at the
    step that committed it), from the same logits.
    """
    return sum_pieces(trajectory_pieces(model, rollout, mask_token_id, temperature, steps_per_forward, chunk_size,
                                        compute_entropy, logits_fn), compute_entropy)


DecoderLogitsFn = Callable[[nn.Module, "Rollout", "Tensor | None"],
                           Iterable[tuple[slice | Tensor, Tensor, Tensor, Tensor]]]
"""`decoder_logits(model, rollout, positions)` yields, step by step and block by block, ``(window, written [B, Lb],
logits [B, Lb, V], tokens [B, Lb])`` (`dllm_ais.sampling.diffusion.step.DecoderStep`): the logits the rollout's
decoder drew the tokens it wrote at that step from (committed, or edited by a token-editing decoder), recomputed by
`model` (`MaskedDiffusionSampler.decoder_logits`: its block cache included), and the block's tokens after the step,
for the blocks holding one of `positions` [B, L] (None: every block)."""

ChoiceReplayFn = Callable[["Rollout"], Callable[[slice | Tensor, Tensor, Tensor], Tensor]]
"""`choice_replay(rollout)` returns a scorer that, called with each step `decoder_logits` yields, in order, returns
that step's commit-choice log-prob terms [B, L] on the completion (`MaskedDiffusionSampler.commit_choice_replay`)."""


def decoder_trajectory_pieces(
    model: nn.Module,
    rollout: Rollout,
    decoder_logits: DecoderLogitsFn,
    temperature: float,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    positions: Tensor | None = None,
    choice_replay: ChoiceReplayFn | None = None,
) -> Iterator[LogprobPiece]:
    """The trajectory estimator scored with the rollout decoder's own logits, one `LogprobPiece` per block (per block
    holding one of `positions` [B, L], whose tokens alone it scores; None: all).

    Where `trajectory_pieces` scores each step's canvas with a full forward (the exact model), this scores each
    committed token by ℓ = log softmax(f_dec(s_t) / τ)[token], f_dec the decoder's logits at the step that
    committed it — with a block KV cache, attending to the keys/values of the block's last refresh, as sampling did.
    On the engine this is exactly what the sampler recorded (`Rollout.step_logprobs`), so the ratio against the
    trainer's value sees the precision alone, and the policy being trained is the cached decoder itself. One piece
    per block: a block's steps share the graph of its cache. A token-editing decoder writes a position more than once:
    its value is then the sum over its writes, each scored at its own step (the recorded value's sum likewise). With
    `choice_replay`, each position's log-prob also holds
    the commit choice's terms scored from the same logits (a stochastic commit rule's log P(choice), split over the
    block's positions as the rollout's commit-choice record is): the log-probability of the whole step, commit choice
    included, whose gradient is the commit order's score function.
    """
    check_sampling_parameters(temperature, top_k=0, top_p=1.0)
    _check_commit_steps(rollout)
    scale = partial(shape_logits, temperature=temperature)
    completion = rollout.completion_ids
    wanted = torch.ones_like(completion, dtype=torch.bool) if positions is None else positions.bool()
    choices = None if choice_replay is None else choice_replay(rollout)
    for _, steps in groupby(decoder_logits(model, rollout, positions), key=lambda step: _block_key(step[0])):
        logprobs = entropy = 0
        piece_positions = torch.zeros_like(completion, dtype=torch.bool)
        for window, step_written, logits, tokens in steps:
            index = _window_index(window, completion)
            written = step_written & (index >= 0) & wanted.gather(1, index.clamp_min(0))
            values = selective_log_softmax(logits[written], tokens[written], chunk_size, process_logits=scale,
                                           compute_entropy=compute_entropy)
            step_logprobs, step_entropy = values if compute_entropy else (values, None)
            placed = torch.zeros_like(completion, dtype=torch.bool)
            placed[written.nonzero(as_tuple=True)[0], index[written]] = True
            piece_positions |= placed
            logprobs = logprobs + _scatter_to_positions(placed, step_logprobs)
            if choices is not None:
                logprobs = logprobs + torch.where(wanted, choices(window, step_written, logits), 0.0)
            if compute_entropy:
                entropy = entropy + _scatter_to_positions(placed, step_entropy)
        yield LogprobPiece(piece_positions, logprobs, entropy if compute_entropy else None)


def _block_key(window: slice | Tensor) -> int:
    """What tells `decoder_logits`' blocks apart, for grouping its steps lazily: a slice's start, or the largest
    completion index of a block-causal model's [B, Lb] index window (the blocks follow one another along the
    completion)."""
    return window.start if isinstance(window, slice) else int(window.max())


def _window_index(window: slice | Tensor, completion: Tensor) -> Tensor:
    """A block's completion positions as [B, Lb] indices into `completion` [B, L] (−1 where a row's block position
    is none: `MaskedDiffusionSampler.decoder_logits`), from a slice or such an index tensor."""
    if isinstance(window, Tensor):
        return window
    return torch.arange(window.start, window.stop, device=completion.device).expand(completion.shape[0], -1)


def _row_step_ranks(commit_step: Tensor) -> tuple[Tensor, Tensor]:
    """(rank [B, L], steps [B]): each token's commit step numbered among its row's distinct steps (0, 1, ...), and
    the number of distinct steps of each row (parallel decoding lets rows skip global step indices)."""
    present = torch.zeros(commit_step.shape[0], int(commit_step.max()) + 1, dtype=torch.long,
                          device=commit_step.device).scatter_(1, commit_step, 1)
    return (present.cumsum(dim=1) - 1).gather(1, commit_step), present.sum(dim=1)


def step_merge_segments(commit_step: Tensor, num_segments: int) -> Tensor:
    """The segment [B, L] of each completion token when each row's T denoising steps are merged into N contiguous
    segments of (nearly) equal length: the token committed at the row's r-th distinct step (r = 0 … T − 1) is in
    segment ⌊r · N / T⌋, so a segment spans ⌊T/N⌋ or ⌈T/N⌉ steps (exactly T/N when N divides T) and N ≥ T leaves
    every step a segment of its own."""
    if not is_plain_int(num_segments) or num_segments < 1:
        raise ValueError(f"the number of segments must be an int >= 1; got {num_segments!r}")
    rank, steps = _row_step_ranks(commit_step)
    return rank * num_segments // steps.unsqueeze(1)


def merges_no_steps(commit_step: Tensor, num_segments: int) -> bool:
    """Whether N = `num_segments` segments leave every step of every row a segment of its own (N ≥ each row's
    step count): step_merge is then the trajectory estimator exactly."""
    return bool((_row_step_ranks(commit_step)[1] <= num_segments).all())


def step_merge_pieces(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    num_segments: int,
    segments_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
    positions: Tensor | None = None,
) -> Iterator[LogprobPiece]:
    """`step_merge_logprobs` forward by forward: one `LogprobPiece` per forward (the tokens committed inside its
    segments), computed when asked for; only the tokens at `positions` [B, L] (None: all), and only the segments
    holding one of them. Arguments are checked at the call, before any forward."""
    _check_staged_scoring(model, rollout, mask_token_id, temperature, segments_per_forward,
                          "segments_per_forward")
    segments = step_merge_segments(rollout.commit_step, num_segments)
    return _staged_pieces(model, rollout, segments, mask_token_id, temperature, segments_per_forward, chunk_size,
                          compute_entropy, logits_fn, positions)


def step_merge_logprobs(
    model: nn.Module,
    rollout: Rollout,
    mask_token_id: int,
    temperature: float,
    num_segments: int,
    segments_per_forward: int = 1,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """d2's StepMerge: the recorded trajectory's denoising steps merged into N segments, one forward each: [B, L].

    Each row's T steps are split into N contiguous segments of about T/N steps (`step_merge_segments`). Segment n,
    starting at step t_n, is scored at the canvas x_{t_n} of its first step: `rollout.sequences` with every
    completion token committed at or after t_n masked. Each token o^k committed inside segment n gets
        ℓ(o^k) = log softmax(f(x_{t_n}) / τ)_{P+k}[o^k]   (τ = 0: plain softmax),
    i.e. the tokens a segment commits are scored as if committed together, independently, at its first step.
    N ≥ T is the exact trajectory log-prob (`trajectory_logprobs`; the sampler's `step_logprobs`); N = 1 scores
    every completion token at the fully masked completion: d1's one-step surrogate with an unmasked prompt. Cost:
    N forwards whatever T (`segments_per_forward` of them stacked along the batch), against T for the trajectory.

    Where we differ from d2 (arXiv 2509.21474): we split each row's own distinct steps (under parallel decoding
    rows take different steps); a T that N does not divide gives segments of ⌊T/N⌋ and ⌈T/N⌉ steps; and we score
    softmax(f / τ), the distribution the sampler drew from (as the trajectory estimator does), so that N ≥ T is
    exactly the trajectory estimator and the sampler's record.

    With `compute_entropy`, also returns the entropy [B, L] of the distribution each token was scored under.
    """
    return sum_pieces(step_merge_pieces(model, rollout, mask_token_id, temperature, num_segments,
                                        segments_per_forward, chunk_size, compute_entropy, logits_fn), compute_entropy)
