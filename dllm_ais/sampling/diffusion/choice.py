"""The complete ratio's commit-choice probability (an experiment: docs/algorithms.md, "The complete ratio"): with a
stochastic commit rule (``position_temperature`` T > 0) the positions a step commits are a draw with a probability,
which the sampler records (`ChoiceRecord`) and the trainer replays (`CommitChoiceReplay`), beside the committed
tokens' own log-probs. Plackett–Luce for a fixed count (by order, or as a set), independent Bernoulli draws with a
forced commit for threshold decoding; plus, when the rule reads them, the log-probs of the candidates drawn and left
uncommitted.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm_ais.rollout import Rollout
from dllm_ais.sampling.diffusion.canvas import CanvasLayout, completion_window
from dllm_ais.sampling.diffusion.rules import depends_on_model, reads_candidates
from dllm_ais.sampling.diffusion.step import DenoiseStep, StepStages, denoise_step, forced_commit_scores


__all__ = ["COMMIT_CHOICE", "ChoiceRecord", "CommitChoice", "CommitChoiceRecord",
           "CommitChoiceReplay", "commit_orders", "committed_set_logprobs", "ranked_choice_logprobs",
           "recorded_choice", "threshold_choice_logprobs"]

COMMIT_CHOICE = "commit_choice"
"""The name of the commit-choice record in `Rollout.records`."""


@dataclass
class CommitChoiceRecord:
    """What a sampling call with a stochastic commit rule (``position_temperature`` > 0) records of its choices,
    held in `Rollout.records` under `COMMIT_CHOICE`.

    logprobs [B, L] float32: the log-probability of each step's other draws, split over positions — the commit
    choice (Plackett–Luce or threshold terms) and the candidates drawn and left uncommitted; a row's
    step_logprobs + logprobs sum to the log-probability of its whole trajectory (docs/algorithms.md, "The complete
    ratio"). rank [B, L]: each token's place in its step's draw order (0 first). discarded_candidates [B, L, K] or
    None: the candidate drawn at position k at the j-th forward of its block and left uncommitted, −1 where none
    (K = block_length), when the ratio holds them.
    """

    logprobs: torch.Tensor
    rank: torch.LongTensor
    discarded_candidates: torch.LongTensor | None = None


def recorded_choice(rollout: Rollout) -> CommitChoiceRecord | None:
    """`rollout`'s commit-choice record, None when its sampler drew no commit choice."""
    return rollout.records.get(COMMIT_CHOICE)


def ranked_choice_logprobs(scores: torch.Tensor, still_masked: torch.Tensor, commit: torch.Tensor,
                           commit_rank: torch.Tensor, position_temperature: float) -> torch.Tensor:
    """float32 [B, Lb]: log P(a fixed-count step's commit choice | the scores), split over the block's positions.

    The committed positions, in the order `commit_rank` (0 = drawn first), are a draw without replacement from
    softmax(c / T) over the still-masked positions (Gumbel-top-k, `perturb_scores_for_sampling`); their
    Plackett–Luce log-probability gives the position drawn j-th c_(j) / T − log Σ_{i not yet drawn} exp(c_i / T), and
    every other position 0.
    """
    scaled = scores.double().masked_fill(~still_masked, -math.inf) / position_temperature
    draw_key = torch.where(commit, -commit_rank.double(), -math.inf)
    order = draw_key.argsort(dim=1, descending=True, stable=True)  # the committed positions first, in draw order
    ordered = scaled.gather(1, order)
    not_yet_drawn = ordered.flip(1).logcumsumexp(dim=1).flip(1)
    terms = torch.where(commit.gather(1, order), ordered - not_yet_drawn, 0.0)
    return torch.zeros_like(terms).scatter(1, order, terms).float()


@functools.lru_cache(maxsize=None)
def commit_orders(count: int, device: torch.device) -> torch.LongTensor:
    """[count!, count] every order of `count` positions (built once per count and device: the sampler scores a set
    at every step)."""
    return torch.tensor(list(itertools.permutations(range(count))), device=device)


def committed_set_logprobs(scores: torch.Tensor, still_masked: torch.Tensor, commit: torch.Tensor,
                           position_temperature: float, max_commits: int) -> torch.Tensor:
    """float32 [B, Lb]: log P(a fixed-count step's committed *set* | the scores), shared equally by its positions.

    The positions are drawn as for `ranked_choice_logprobs` (without replacement from softmax(c / T)); the canvas
    after the step depends on which were drawn, not on their order, so the set's probability is the Plackett–Luce
    probability summed over its k! orders: the ordered ratio with the order summed out (Rao–Blackwellised). Each
    committed position gets log P(set) / k, every other 0. A row commits at most `max_commits` positions.
    """
    absent = -1e300  # a weight of exactly 0 whose log keeps the gradients finite
    max_commits = min(max_commits, scores.shape[1])
    scaled = (scores.double() / position_temperature).masked_fill(~still_masked, absent)
    first = commit.double().argsort(dim=1, descending=True, stable=True)[:, :max_commits]
    chosen = commit.gather(1, first)
    drawn = scaled.gather(1, first).masked_fill(~chosen, absent)  # [B, K], padded past a row's k
    rest = scaled.masked_fill(commit, absent).logsumexp(dim=1, keepdim=True)
    orders = commit_orders(max_commits, scores.device)  # [K!, K]
    permuted, real = drawn[:, orders], chosen[:, orders]  # [B, K!, K]
    not_yet_drawn = torch.logaddexp(permuted.flip(-1).logcumsumexp(dim=-1).flip(-1), rest.unsqueeze(-1))
    per_order = torch.where(real, permuted - not_yet_drawn, 0.0).sum(dim=-1)
    k = chosen.sum(dim=1).double()
    # each order of the k real positions is K! / k! orders of the padded K: the same term that many times
    log_set = per_order.logsumexp(dim=-1) - math.lgamma(max_commits + 1) + torch.lgamma(k + 1)
    return torch.where(commit, (log_set / k.clamp_min(1)).unsqueeze(1), 0.0).float()


def threshold_choice_logprobs(commit_logits: torch.Tensor, stay_logprobs: torch.Tensor, forced_scores: torch.Tensor,
                              still_masked: torch.Tensor, commit: torch.Tensor, position_temperature: float
                              ) -> torch.Tensor:
    """float32 [B, Lb]: log P(a threshold step's commit set), split over the block's positions (`threshold_commits`).

    With p_i = σ(`commit_logits`_i) the commit probability of the token committed at i and π = softmax(m / T) over
    the masked positions (m = `forced_scores`), a committed position gets log p_i, the only committed position of a
    row log(p_i + (1 − p_i) π_i) (that Bernoulli outcome, or the forced commit after none: its candidate then failed
    its own draw), and a position left masked `stay_logprobs`_i, the log-probability that it stays masked.
    """
    commit_logits = commit_logits.double()
    forced = (forced_scores.double().masked_fill(~still_masked, -math.inf) / position_temperature).log_softmax(dim=1)
    single = commit.sum(dim=1, keepdim=True) == 1
    single_terms = torch.logaddexp(F.logsigmoid(commit_logits), F.logsigmoid(-commit_logits) + forced)
    terms = torch.where(commit, torch.where(single, single_terms, F.logsigmoid(commit_logits)), stay_logprobs.double())
    return torch.where(still_masked, terms, 0.0).float()


class CommitChoice:
    """The commit-choice probability of `sampler`'s steps: its settings and remasking rule, read by the recorder
    while sampling and by the replay while training."""

    def __init__(self, sampler: StepStages):
        self.sampler, self.config, self.rule = sampler, sampler.config, sampler.remasking_rule

    @property
    def depends_on_model(self) -> bool:
        """Whether the choice's probability depends on the model (not for the ``random`` and ``origin`` rules)."""
        return depends_on_model(self.rule)

    @property
    def records_discarded_candidates(self) -> bool:
        """Whether the complete ratio holds the candidates drawn and left uncommitted (their log-probs, and the
        record `discarded_candidates`): for a rule that reads them, unless threshold decoding sums over them
        (`stay_logprobs`, for a rule marked `scores_candidate_probability`)."""
        marginalised = self.config.threshold is not None and getattr(self.rule, "scores_candidate_probability", False)
        return reads_candidates(self.rule) and not marginalised

    def stay_logprobs(self, logits: torch.Tensor, commit_logits: torch.Tensor) -> torch.Tensor:
        """[B, Lb] log P(position i stays masked) at a threshold step, `commit_logits` = (c − τ_c) / T at the drawn
        candidates: log(1 − σ(commit_logits)) (the candidate recorded, or read by no rule); for a rule marked
        `scores_candidate_probability`, summed over the candidate instead,
        log Σ_v q_i(v) (1 − σ((s_i(v) − τ_c) / T)), with q_i = softmax(logits / τ) what the candidate is drawn from
        (a point mass on the argmax at τ = 0) and s_i(v) = softmax(rule logits)[v] every token's score."""
        if self.records_discarded_candidates or not reads_candidates(self.rule):
            return F.logsigmoid(-commit_logits.double())
        config = self.config
        token_scores = F.softmax(self.sampler.rule_logits(logits), dim=-1).float()
        stays = F.logsigmoid(-(token_scores - config.threshold) / config.position_temperature)
        if config.temperature > 0:
            draws = F.log_softmax(logits.float() / config.temperature, dim=-1)
        else:
            draws = torch.full_like(stays, -math.inf).scatter(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
        return torch.logsumexp(stays + draws, dim=-1)

    def step_logprobs(self, step: DenoiseStep, still_masked: torch.Tensor) -> torch.Tensor:
        """float32 [B, Lb]: the log-probability of one step's outcome beyond its committed tokens', split over the
        block's positions, from the `step`'s logits and the rule's scores of its candidates: the commit choice
        (`ranked_choice_logprobs` for a fixed count, or `committed_set_logprobs` with `commit_choice_as_set`;
        `threshold_choice_logprobs` for threshold decoding; 0 for a rule whose choice does not depend on the model)
        plus, when the ratio holds them (`records_discarded_candidates`), the log-prob of the candidate drawn at each
        still-masked position left uncommitted. With the committed tokens' log-probs (`step_logprobs`) this is the
        probability of the step's outcome; docs/algorithms.md, "The complete ratio"."""
        config, commit = self.config, step.commit
        terms = torch.zeros_like(step.logprobs, dtype=torch.float32)
        if self.depends_on_model and config.threshold is None and config.commit_choice_as_set:
            terms = committed_set_logprobs(step.scores, still_masked, commit, config.position_temperature,
                                           config.max_commits_per_step)
        elif self.depends_on_model and config.threshold is None:
            terms = ranked_choice_logprobs(step.scores, still_masked, commit, step.commit_rank,
                                           config.position_temperature)
        elif self.depends_on_model:
            commit_logits = (step.scores.double() - config.threshold) / config.position_temperature
            terms = threshold_choice_logprobs(commit_logits, self.stay_logprobs(step.logits, commit_logits),
                                              forced_commit_scores(self.sampler, step.logits, step.scores),
                                              still_masked, commit, config.position_temperature)
        if self.records_discarded_candidates:
            terms = terms + torch.where(still_masked & ~commit, step.logprobs, 0.0)
        return terms


@dataclass
class ChoiceRecord:
    """What a sampling call with a stochastic commit rule (``position_temperature`` > 0) records of its choices
    besides the committed tokens, per canvas position [B, T] until `record` reads them at the completion's
    (`CommitChoiceRecord`): `choice_logprobs` (each step's `CommitChoice.step_logprobs`, added up
    per position), `commit_rank` (the draw order among a step's commits) and, when the sampler's ratio needs them
    (`CommitChoice.records_discarded_candidates`), `discarded_candidates` [B, T, block_length] (the candidate drawn
    at a position at the k-th forward of its block and left uncommitted, −1 where none)."""

    choice: CommitChoice
    choice_logprobs: torch.Tensor
    commit_rank: torch.LongTensor
    discarded_candidates: torch.LongTensor | None

    @classmethod
    def empty(cls, shape: torch.Size, sampler: StepStages, device: torch.device) -> "ChoiceRecord":
        choice = CommitChoice(sampler)
        discarded = (torch.full((*shape, sampler.config.block_length), -1, dtype=torch.long, device=device)
                     if choice.records_discarded_candidates else None)
        return cls(choice, torch.zeros(shape, dtype=torch.float32, device=device),
                   torch.zeros(shape, dtype=torch.long, device=device), discarded)

    def add_step(self, block: slice, forward_in_block: int, step: DenoiseStep, still_masked: torch.Tensor) -> None:
        """Record `step` of the canvas block `block` (its `forward_in_block`-th forward, from 0)."""
        commit = step.commit
        self.choice_logprobs[:, block] += self.choice.step_logprobs(step, still_masked)
        if step.commit_rank is not None:
            self.commit_rank[:, block] = torch.where(commit, step.commit_rank, self.commit_rank[:, block])
        if self.discarded_candidates is not None:
            self.discarded_candidates[:, block, forward_in_block] = torch.where(still_masked & ~commit,
                                                                                step.candidates, -1)

    def record(self, layout: CanvasLayout) -> CommitChoiceRecord:
        """The record at the completion positions of `layout`."""
        discarded = self.discarded_candidates
        return CommitChoiceRecord(layout.completion(self.choice_logprobs), layout.completion(self.commit_rank),
                                  None if discarded is None else layout.completion(discarded))


class CommitChoiceReplay:
    """The log-probability terms [B, L] of a rollout's recorded commit choices (and discarded candidates, when the
    ratio holds them), one replayed step at a time: called with each ``(block, committed, logits)`` that
    `MaskedDiffusionSampler.decoder_logits` yields, in order, it returns that step's `CommitChoice.step_logprobs` of
    the recorded choice (`CommitChoiceRecord`: its rank and discarded candidates) on the completion's positions, 0 elsewhere.
    The step is `denoise_step` with the rollout's tokens as candidates and the recorded commits, so the rule scores
    the step's `logits` as sampling did (top-p / top-k filtered) and the terms are differentiable in them: the
    trainer's log-prob of the commit choice, from the logits the trajectory estimator scores."""

    def __init__(self, sampler: StepStages, rollout: Rollout):
        self.choice, self.record = CommitChoice(sampler), recorded_choice(rollout)
        if self.record is None or (self.choice.records_discarded_candidates
                                   and self.record.discarded_candidates is None):
            raise ValueError("The commit choice's log-prob needs a rollout that records its commit choices: sample "
                             "with position_temperature > 0 (experimental.rollout_position_temperature)")
        self.sampler, self.rollout = sampler, rollout
        self.block, self.still_masked, self.step = None, None, 0

    def __call__(self, window: slice | torch.LongTensor, committed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        record, completion = self.record, self.rollout.completion_ids
        if window is not self.block:  # a new block: every completion position in it masked
            self.block, self.step = window, 0
            self.still_masked = torch.ones_like(committed) if isinstance(window, slice) else window >= 0
        tokens = completion_window(completion, window)
        candidates = tokens
        if self.choice.records_discarded_candidates:
            discarded = completion_window(record.discarded_candidates[:, :, self.step], window)
            candidates = torch.where(committed | (discarded < 0), tokens, discarded)
        step = denoise_step(self.sampler, logits, tokens, self.still_masked, None, width=tokens.shape[1],
                            forced_tokens=candidates, commit=committed, score=self.choice.depends_on_model)
        step.commit_rank = completion_window(record.rank, window)
        terms = self.choice.step_logprobs(step, self.still_masked)
        self.still_masked = self.still_masked & ~committed
        self.step += 1
        if isinstance(window, slice):
            start = window.start or 0
            return F.pad(terms, (start, completion.shape[1] - start - terms.shape[1]))
        placed = torch.zeros(completion.shape, dtype=terms.dtype, device=terms.device)
        return placed.scatter_add(1, window.clamp_min(0), torch.where(window >= 0, terms, 0.0))
