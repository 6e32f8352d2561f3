"""One denoising step of a block, written once: given the block's tokens, which of its positions are still masked and
the block's logits, the candidates drawn and their log-probs, the remasking rule's scores, and which positions commit.

Sampling calls `denoise_step` with the commit counts of its schedule (or none: parallel decoding's counts come from
the scores, on the device); the commit-choice replay (`dllm_ais.sampling.diffusion.choice.CommitChoiceReplay`) calls
it with the rollout's tokens as the candidates and the recorded commits, and reads the same scores sampling read. The
step holds no state: the caller keeps the canvas, the mask state and the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from dllm_ais.sampling.diffusion.draw import filter_top_p_top_k, masked_positions_first, perturb_scores_for_sampling
from dllm_ais.sampling.diffusion.rules import RemaskingRule, reads_candidates
from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig
from dllm_ais.sampling.diffusion.schedule import parallel_commit_counts


__all__ = ["DecoderStep", "DenoiseStep", "StepStages", "denoise_step", "draw_ranks", "forced_commit_scores", "threshold_commits",
           "top_ranked_positions"]


class StepStages(Protocol):
    """What a denoising step reads of its sampler (`MaskedDiffusionSampler`): the settings, the remasking rule, and
    the stages a subclass may override."""

    config: DiffusionSamplerConfig
    remasking_rule: RemaskingRule

    def propose_tokens(self, logits: torch.Tensor, generator: torch.Generator | None
                       ) -> tuple[torch.LongTensor, torch.Tensor]: ...

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor: ...

    def rule_scores(self, logits: torch.Tensor, candidates: torch.Tensor,
                    generator: torch.Generator | None) -> torch.Tensor: ...

    def rule_logits(self, logits: torch.Tensor) -> torch.Tensor: ...

    def choose_positions(self, scores: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor: ...


@dataclass
class DenoiseStep:
    """What one denoising step of a block drew, scored and committed.

    logits [B, Lb, V]: the block's logits after the top-p / top-k filter (what the candidates are drawn from);
    candidates [B, Lb]: the block's tokens with a candidate at each still-masked position; logprobs [B, Lb] float32:
    each candidate's log-prob under the distribution it was drawn from (0 where the position was committed before);
    scores [B, Lb]: the remasking rule's scores of the candidates (None when not asked for); commit [B, Lb] bool: the
    positions this step commits; commit_rank [B, Lb]: with a drawn commit choice of a fixed count, the draw order
    among the commits (0 first), else None.
    """

    logits: torch.Tensor
    candidates: torch.LongTensor
    logprobs: torch.Tensor
    scores: torch.Tensor | None
    commit: torch.Tensor
    commit_rank: torch.LongTensor | None = None


class DecoderStep(NamedTuple):
    """One step of a block as the decoder replay (`MaskedDiffusionSampler.decoder_logits`) recomputes it.

    window: the block's completion positions (a slice, or [B, Lb] indices with −1 where a row's block position is no
    completion position: `CanvasLayout.completion_window`); written [B, Lb] bool: the block positions the step wrote
    (committed, or edited by a token-editing decoder); logits [B, Lb, V]: the block's logits at the step; tokens
    [B, Lb]: the block's tokens after the step, so the tokens written where `written` (an edited position's final
    token may be a later write's).
    """

    window: slice | torch.LongTensor
    written: torch.Tensor
    logits: torch.Tensor
    tokens: torch.LongTensor


def denoise_step(sampler: StepStages, logits: torch.Tensor, block_tokens: torch.LongTensor,
                 still_masked: torch.Tensor, generator: torch.Generator | None, *, width: int,
                 counts: list[int] | torch.Tensor | None = None, floor: torch.Tensor | None = None,
                 row: tuple[int, slice] | None = None, forced_tokens: torch.LongTensor | None = None,
                 commit: torch.Tensor | None = None, score: bool = True, rank: bool = False) -> DenoiseStep:
    """One step of the block whose tokens are `block_tokens` [B, Lb] (`still_masked` [B, Lb] the positions still
    masked) from the block's `logits` [B, Lb, V] under `sampler`'s settings and stages.

    Candidates: drawn (`sampler.propose_tokens`) at the still-masked positions, gathered `width` wide (at least each
    row's masked count) so that only those draw noise, or, replaying, the tokens `forced_tokens` [B, Lb] holds there
    (`sampler.token_logprobs`). Scores: the rule's (`sampler.rule_scores`) unless `score` is False. Commits: `commit`
    when given (a replay), else chosen over the canvas row (`row` = (canvas length, the block's slice): the block's
    scores placed in a row of −∞, as the official implementation ranks them, so that ties break alike): `counts` per
    row (a host list: the fixed schedule) of the top scores, drawn from softmax(score / T) without replacement with
    ``position_temperature`` T > 0 (`rank`: record the draw order);
    with `counts` None, parallel decoding's counts (`parallel_commit_counts`, at least `floor` [B] when given),
    computed and applied on the device; with a threshold and T > 0, each position's own draw
    (`dllm_ais.sampling.diffusion.choice.threshold_commits`).
    """
    config = sampler.config
    logits = filter_top_p_top_k(logits, config.temperature, config.top_p, config.top_k)
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1)
    active = masked_positions_first(still_masked, width)
    if forced_tokens is None:
        drawn, drawn_logprobs = sampler.propose_tokens(logits[rows, active], generator)
    else:
        drawn = forced_tokens.gather(1, active)
        drawn_logprobs = sampler.token_logprobs(logits[rows, active], drawn)
    candidates = block_tokens.scatter(1, active, drawn)
    logprobs = torch.zeros(candidates.shape, dtype=torch.float32, device=logits.device).scatter(1, active,
                                                                                              drawn_logprobs)
    scores = sampler.rule_scores(logits, candidates, generator) if score else None
    step = DenoiseStep(logits, candidates, logprobs, scores, commit)
    if commit is None:
        step.commit, step.commit_rank = _choose_commits(sampler, step, still_masked, counts, floor, row, generator,
                                                        rank)
    return step


def _choose_commits(sampler: StepStages, step: DenoiseStep, still_masked: torch.Tensor,
                    counts: list[int] | torch.Tensor | None, floor: torch.Tensor | None, row: tuple[int, slice],
                    generator: torch.Generator | None, rank: bool) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """The positions `denoise_step` commits ([B, Lb] bool) and their draw order (or None)."""
    config = sampler.config
    if config.threshold is not None and config.position_temperature > 0:
        forced = forced_commit_scores(sampler, step.logits, step.scores)
        return threshold_commits(step.scores, forced, still_masked, config.threshold, config.position_temperature,
                                 generator), None
    if counts is None:
        counts = parallel_commit_counts(step.scores, still_masked, config.threshold, config.factor)
        if floor is not None:  # SDAR's low_confidence_dynamic: at least the step's scheduled count
            counts = torch.minimum(torch.maximum(counts, floor), still_masked.sum(dim=1))
    canvas_length, block = row
    row_scores = step.scores.new_full((step.scores.shape[0], canvas_length), -math.inf)
    row_scores[:, block] = step.scores.masked_fill(~still_masked, -math.inf)
    if config.position_temperature > 0:
        row_scores = perturb_scores_for_sampling(row_scores, config.position_temperature, generator)
    commit = sampler.choose_positions(row_scores, counts)[:, block] & still_masked
    return commit, draw_ranks(row_scores[:, block], commit) if rank else None


def top_ranked_positions(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: per row b, its `counts[b]` highest `scores` (ties: the lower position first), chosen on the
    device for counts [B] that live there (parallel decoding's: no host read)."""
    order = scores.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                             .expand_as(order))
    return ranks < counts.unsqueeze(1)


def draw_ranks(keys: torch.Tensor, commit: torch.Tensor) -> torch.LongTensor:
    """[B, Lb] the rank of each committed position by descending `keys` (0 = largest: drawn first), the positions
    after them for the others."""
    order = torch.where(commit, keys.double(), -math.inf).argsort(dim=1, descending=True, stable=True)
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ranks)


def threshold_commits(scores: torch.Tensor, forced_scores: torch.Tensor, still_masked: torch.Tensor, threshold: float,
                      position_temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[B, Lb] bool: threshold decoding as a draw with an exact probability (`rollout.threshold` with
    `position_temperature` T > 0). Each still-masked position i commits independently with probability
    p_i = σ((c_i − τ_c) / T), c_i its score; a row that has a masked position but commits none of them commits one
    drawn from softmax(m / T) over its masked positions (the forced commit), m = `forced_scores`, the rule's scores of
    the most probable tokens, which read no drawn candidate. T → 0 is Fast-dLLM's rule (every c_i > τ_c, else the top
    score; with greedy candidates m = c). Uniforms in float64 and the forced draw's Gumbel noise come from
    `generator`."""
    logits = (scores.double() - threshold) / position_temperature
    uniform = torch.rand(scores.shape, generator=generator, device=scores.device, dtype=torch.float64)
    commit = (uniform < torch.sigmoid(logits)) & still_masked
    forced = perturb_scores_for_sampling(forced_scores.double().masked_fill(~still_masked, -math.inf),
                                         position_temperature, generator).argmax(dim=1, keepdim=True)
    needs_forced = still_masked.any(dim=1, keepdim=True) & ~commit.any(dim=1, keepdim=True)
    return commit | (torch.zeros_like(commit).scatter(1, forced, True) & needs_forced)


def forced_commit_scores(sampler: StepStages, logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """[B, Lb] the scores threshold decoding draws its forced commit from (`threshold_commits`): the rule's `scores`
    when it reads no candidate, else its scores of each position's most probable token, so that the forced choice
    reads no drawn candidate either."""
    if not reads_candidates(sampler.remasking_rule):
        return scores
    return sampler.rule_scores(logits, logits.argmax(dim=-1), None)
