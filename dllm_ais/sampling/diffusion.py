"""Masked-diffusion sampling: the LLaDA generation algorithm, recording the behaviour policy.

Formulas: docs/algorithms.md, section "Masked-diffusion sampling".

The canvas starts as ``[left-padded prompt | MASK x gen_length]`` and is filled in semi-autoregressive blocks of
``block_length`` positions, left to right, ``steps / n_blocks`` denoising steps per block. Each step runs one
forward over the whole canvas, proposes a token for every still-masked position of the current block (Gumbel-max at
temperature τ, plain argmax at τ = 0), scores those positions with a remasking rule, and commits the top-scored ones.
With τ = 0, ``remasking="low_confidence"`` and the defaults below, the committed tokens are those of the official
LLaDA ``generate``.

Dream's decoding (its official ``diffusion_generate``) is options of the same sampler: ``schedule="time_linear"``
(⌊n (1 − s/t)⌋ commits per step), the position rules ``maskgit_plus``, ``topk_margin``, ``entropy`` and ``origin``,
``position_temperature`` (``alg_temp``) and ``top_p`` / ``top_k``; with one block over the whole completion and
τ = 0 the committed tokens are the official ones (tests/test_dream_sampling.py). Dream's logits at position i − 1
predict position i: `block_logits` reads them so (`dllm_ais.models.families`), for the sampler and for every
estimator that scores through it.

Faster rollouts (Fast-dLLM style) are options of the same sampler:

- ``cache="prefix" | "dual"``: a block KV cache. The first step of each block runs the whole canvas and keeps every
  layer's keys/values; the block's later steps run the model on the current block and everything after it
  (``prefix``) or on the current block only (``dual``), attending to the cached keys/values of the other positions.
- ``threshold`` / ``factor``: parallel decoding. Each step commits every still-masked block position whose score
  exceeds τ_c (or the largest n with (n + 1)(1 − c_(n)) < f), at least one; a block runs until it is filled, so the
  number of steps varies per row (``Rollout.num_steps``).
- ``remasking="left_to_right"`` with one token per step (``steps = gen_length``) decodes in autoregressive order
  (JustGRPO); with a cache, blocks of several positions are what make it cheaper (a block of one position would
  refresh the cache at every step).

All three change the behaviour policy: the recorded log-probs are those of the (approximate) logits the tokens were
actually drawn from, so the trajectory estimator's importance ratio sees the approximation.

Block-causal models (SDAR: `dllm_ais.models.families.BLOCK_CAUSAL_MODEL_TYPES`, or ``block_causal=True``) attend
causally across blocks of ``config.block_size`` positions counted from each row's first real token. Their official
decoder (JetAstra/SDAR ``generate.py``, one row) decodes the model's own blocks in turn, the first of them holding
the prompt's tail as fixed tokens, each against the cache of the finished blocks. The sampler does the same for every
row of a batch, on a block-aligned canvas (`block_aligned_layout`): each left-padded prompt is moved right by whole
blocks' worth of padding so that every row's blocks start at the same canvas positions; one slice of the canvas is
then the current block of every row, and one forward with one ``cache_position`` serves the batch (the model numbers
positions from each row's first real token, so the extra padding changes no logit). Where a row's completion starts
mid-block, its first decoded block holds the prompt's tail and its last one is cut at ``gen_length`` (the official
decoder would fill that block past ``gen_length``; a block ending at ``gen_length`` is decoded exactly as there).
The records are mapped back to the rollout's left-padded layout. What the official decoder's settings are here:
``block_length`` = the model's ``block_size``; ``steps`` = its ``denoising_steps`` × the number of blocks of
``gen_length`` (each block's commits split ``block_length`` evenly over its steps, as ``get_num_transfer_tokens``;
a block holding fewer masked positions commits them in its first steps); ``remasking="maskgit_plus"`` its
``low_confidence_static`` (the drawn token's probability under the distribution it was drawn from),
``"left_to_right"`` its ``sequential``, and ``maskgit_plus`` with ``threshold`` its ``low_confidence_dynamic`` (every
position above the threshold, at least the step's scheduled count). Any cache mode uses the exact cache: the prompt's
full blocks written once, each step a forward of the current block alone against the cache, and a finished block's
clean keys/values written by the next block's first forward (over both blocks); ``cache="none"`` runs every step
over the whole canvas, with the same logits. Its ``entropy_bounded`` strategy is broken upstream and not offered; a
stop token ends the completion (its mask) but not the decoding, which later blocks cannot change.

Besides the tokens, every committed token's step index and log-probability under the distribution it was drawn
from are recorded in the returned `Rollout` (``commit_step``, ``step_logprobs``): these are the behaviour-policy
probabilities that the importance-sampling correction compares with the trainer's. With ``position_temperature``
> 0 the commit choice is a draw too, and its log-probability (with the candidates drawn and discarded) is recorded
beside them (``choice_logprobs``, ``commit_rank``, ``discarded_candidates``), computed in the same step; the trainer
replays it with `MaskedDiffusionSampler.choice_logprobs` (docs/algorithms.md, "The complete ratio").

The model is called as ``model(input_ids, attention_mask=…, logits_to_keep=positions)`` (a 1-D tensor of the
positions whose logits are read, as transformers' causal LMs take it) and, with a cache, also with
``past_key_values``, ``cache_position`` and ``use_cache`` as dllm_ais' LLaDA and Dream take them.

Extension points:

- a remasking rule: any callable ``rule(block_logits [B, Lb, V], candidates [B, Lb], generator) -> scores [B, Lb]``
  passed as ``DiffusionSamplerConfig(remasking=rule)`` or registered by name with `register_remasking_rule`;
  higher scores are committed first.
- a whole sampler: subclass `MaskedDiffusionSampler` and override one of the per-step stages
  `block_logits` (the forward pass(es) and logit processing: e.g. another guidance),
  `propose_tokens` (how candidates are drawn and their log-probs: e.g. top-p; the log-prob must be that of the
  distribution actually sampled) or `choose_positions` (which scored positions are committed).

What training with a sampler (``GRPOTrainer(config, sampler=...)``) relies on: `scoring_logits` — `block_logits`
without a cache — is the likelihood estimators' ``logits_fn``, so whatever `block_logits` does to the logits is
scored exactly as sampled, by every estimator. The trajectory estimator scores a committed token by
softmax(logits / τ) (the default `token_logprobs`); a subclass that overrides `token_logprobs` (drawing from another
distribution of the same logits) can therefore not be scored by it and is refused with it (`policy.DiffusionPolicy`):
express such processing as logits in `block_logits` (e.g. −inf outside a top-p set), or use the one-step estimator,
which scores the logits without temperature whatever the draw. `with_config` must give the same sampler with other
settings (greedy for its held-out score, no cache for an exact-order replay).

Speed: apart from the forward, every per-step operation touches only the current block's logits
``[B, block_length, V]``, and the float64 Gumbel noise and float32 log-probs only its still-masked positions; the
LM head runs at the block's positions only. The fixed schedules need no host synchronisation in the step loop;
parallel decoding one per step (its data-dependent counts, which also tell when a block is filled), ``origin`` one
per step (its random counts). The rollout engine's model may carry static forwards (``rollout.compile``:
`dllm_ais.sampling.static_forwards`), through which the sampling forwards run as CUDA graphs with the key/value
cache in buffers written in place; the step itself, and so every rule and subclass, is unchanged by them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dllm_ais.choices import CACHE_DTYPES, CACHE_MODES, COMMIT_SCHEDULES
from dllm_ais.models.families import is_block_causal, logit_source_positions, logits_are_shifted
from dllm_ais.rollout import PromptError, Rollout, completion_mask_through_first_eos, padding_or_none, token_id_tuple
from dllm_ais.sampling.fp8_cache import FP8KeyValueCache
from dllm_ais.sampling.static_forwards import bucketed_prompt_length, static_forwards_of

__all__ = [
    "CACHE_MODES",
    "BlockCache",
    "CanvasLayout",
    "block_aligned_layout",
    "completion_window",
    "DiffusionSamplerConfig",
    "MaskedDiffusionSampler",
    "REMASKING_RULES",
    "RemaskingRule",
    "SpecialTokenIds",
    "filter_top_p_top_k",
    "gumbel_argmax",
    "left_to_right_scores",
    "low_confidence_scores",
    "masked_positions_first",
    "negative_entropy_scores",
    "origin_commit_counts",
    "parallel_commit_counts",
    "perturb_scores_for_sampling",
    "random_scores",
    "register_remasking_rule",
    "resolve_remasking_rule",
    "sampled_token_probability_scores",
    "scores_candidate_probability",
    "sampling_logprobs",
    "scores_sampling_distribution",
    "time_linear_commit_count",
    "top_log_odds_scores",
    "top_probability_scores",
    "top_two_margin_scores",
    "transfer_schedule",
]

RemaskingRule = Callable[[torch.Tensor, torch.Tensor, "torch.Generator | None"], torch.Tensor]


def scores_candidate_probability(rule: RemaskingRule) -> RemaskingRule:
    """Mark a remasking rule whose score of a candidate x̂ is its probability softmax(rule logits)[x̂]: every token's
    score is then known at once (the softmax), so the complete ratio of threshold decoding can sum the commit
    probability over the candidates instead of recording the ones discarded (`threshold_stay_logprobs`)."""
    rule.scores_candidate_probability = True
    return rule


@scores_candidate_probability
def low_confidence_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = softmax(logits)[x̂]: the model's probability of its own candidate, without temperature.

    Computed in the logits' dtype, as the official implementation does (in bf16 this decides ties).
    """
    return F.softmax(block_logits, dim=-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)


def ignores_candidates(rule: RemaskingRule) -> RemaskingRule:
    """Mark a remasking rule whose scores do not depend on the candidates (only on the logits, or on nothing): the
    candidates it leaves uncommitted then play no part in the commit choice, and the complete ratio leaves their
    log-probs out (`MaskedDiffusionSampler.choice_logprobs`). Unmarked rules (and every registered callable) are
    taken to read them."""
    rule.ignores_candidates = True
    return rule


@ignores_candidates
def top_probability_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = max_v softmax(logits)[v]: the model's confidence in its most probable token, whatever was drawn
    (`low_confidence` with greedy candidates; with sampled ones, a commit choice that reads no candidate, so the
    complete ratio needs none of the discarded ones). Computed in the logits' dtype, as `low_confidence`."""
    return F.softmax(block_logits, dim=-1).amax(dim=-1)


@ignores_candidates
def top_log_odds_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = log(p₁ / (1 − p₁)) with p₁ = max_v softmax(logits)[v]: `top_probability`'s confidence as log-odds,
    computed as z₁ − logsumexp of the other logits in float32 (finite where p₁ rounds to 1). The same order as
    `top_probability` (whose ties in a low-precision dtype it may break), so T = 0 decodes as it does; with T > 0 the
    draw separates near-certain positions, whose probabilities all sit within T of 1 but whose log-odds do not."""
    logits = block_logits.float()
    top = logits.max(dim=-1, keepdim=True)
    others = logits.scatter(-1, top.indices, -math.inf).logsumexp(dim=-1)
    return top.values.squeeze(-1) - others


@ignores_candidates
def random_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score ~ U(0, 1) i.i.d. per position (float32, drawn from `generator`): commits positions in random order."""
    return torch.rand(candidates.shape, generator=generator, device=candidates.device)


@ignores_candidates
def left_to_right_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = −(index in the block): the leftmost still-masked position is committed first (autoregressive order)."""
    return -torch.arange(candidates.shape[1], dtype=torch.float32, device=candidates.device).expand(candidates.shape)


def scores_sampling_distribution(rule: RemaskingRule) -> RemaskingRule:
    """Mark a remasking rule as scoring the distribution the candidates were drawn from: the sampler passes it
    logits / τ (τ > 0) instead of the logits themselves, which unmarked rules get (LLaDA scores without
    temperature). Dream's rules are marked; so can a registered rule be."""
    rule.scores_sampling_distribution = True
    return rule


@scores_candidate_probability
@scores_sampling_distribution
def sampled_token_probability_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = softmax(logits / τ)[x̂]: the probability of the candidate under the distribution it was drawn from
    (Dream's ``maskgit_plus``; the sampler passes this rule the tempered logits: `scores_sampling_distribution`)."""
    return F.softmax(block_logits, dim=-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)


@ignores_candidates
@scores_sampling_distribution
def top_two_margin_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = p_(1) − p_(2), the gap between the two most probable tokens of softmax(logits / τ) (Dream's
    ``topk_margin``)."""
    top_two = F.softmax(block_logits, dim=-1).topk(2, dim=-1).values
    return top_two[..., 0] - top_two[..., 1]


@ignores_candidates
@scores_sampling_distribution
def negative_entropy_scores(
    block_logits: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """score = Σ_v p_v log(p_v + 10⁻¹⁰) with p = softmax(logits / τ): the negative entropy, so the most certain
    position commits first (Dream's ``entropy``, with its 10⁻¹⁰)."""
    probs = F.softmax(block_logits, dim=-1)
    return (probs * torch.log(probs + 1e-10)).sum(dim=-1)


REMASKING_RULES: dict[str, RemaskingRule] = {
    "low_confidence": low_confidence_scores, "random": random_scores, "left_to_right": left_to_right_scores,
    "maskgit_plus": sampled_token_probability_scores, "topk_margin": top_two_margin_scores,
    "entropy": negative_entropy_scores, "origin": random_scores, "top_probability": top_probability_scores,
    "top_log_odds": top_log_odds_scores,
}
"""LLaDA's rules (low_confidence, random), autoregressive order (left_to_right), Dream's (maskgit_plus,
topk_margin, entropy, origin), and top_probability (low_confidence without reading the candidate) with its log-odds
top_log_odds (for a drawn commit order). ``origin`` commits each still-masked position with probability 1 − s/t of the
time-linear schedule (Dream's default): uniformly random positions, in a Binomial number per step
(`origin_commit_counts`)."""


def register_remasking_rule(name: str, rule: RemaskingRule, *, replace: bool = False) -> None:
    """Make `rule` selectable as ``DiffusionSamplerConfig(remasking=name)`` (and from YAML recipes)."""
    if not callable(rule):
        raise TypeError(f"Remasking rule {name!r} must be callable as rule(block_logits, candidates, generator).")
    if name in REMASKING_RULES and not replace:
        raise ValueError(f"A remasking rule named {name!r} is already registered; pass replace=True to override it.")
    REMASKING_RULES[name] = rule


def resolve_remasking_rule(remasking: str | RemaskingRule) -> RemaskingRule:
    """The callable for a registered rule name, or `remasking` itself when it is already a callable."""
    if callable(remasking):
        return remasking
    if remasking not in REMASKING_RULES:
        raise ValueError(
            f"Unknown remasking rule {remasking!r}; valid names: {sorted(REMASKING_RULES)}. "
            "Register your own with dllm_ais.sampling.diffusion.register_remasking_rule(name, fn) or pass the callable."
        )
    return REMASKING_RULES[remasking]


def transfer_schedule(masked_counts: torch.Tensor, steps: int) -> torch.LongTensor:
    """[B, steps] number of tokens to commit at each step of a block holding `masked_counts` [B] masked positions.

    The count n_b is split evenly, the remainder going one each to the first steps:
    ``schedule[b, s] = n_b // steps + (s < n_b % steps)``, so each row sums to n_b.
    """
    counts = masked_counts.long().reshape(-1, 1)
    step_index = torch.arange(steps, device=counts.device)
    return counts // steps + (step_index < counts % steps).long()


def time_linear_commit_count(masked_count: int, step: int, steps: int, eps: float) -> int:
    """Tokens to commit at `step` (0-based) of `steps` when `masked_count` positions are still masked, on Dream's
    schedule: with t_i = linspace(1, ε, steps + 1)[i], ⌊n (1 − t_{i+1} / t_i)⌋ in float32 as the official code
    computes it, and every remaining position at the last step."""
    if step >= steps - 1:
        return masked_count
    times = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(float(masked_count)) * (1 - times[step + 1] / times[step]))


def origin_commit_counts(masked_counts: list[int], step: int, steps: int, eps: float,
                         generator: torch.Generator | None) -> list[int]:
    """Per row, how many still-masked positions Dream's ``origin`` rule commits at `step`: each of the n_b positions
    independently with probability p = 1 − t_{i+1} / t_i (every one at the last step), i.e. a Binomial(n_b, p)
    count of uniformly random positions, drawn from `generator`."""
    if step >= steps - 1:
        return list(masked_counts)
    times = torch.linspace(1, eps, steps + 1)
    device = generator.device if generator is not None else torch.device("cpu")
    counts = torch.tensor(masked_counts, dtype=torch.float32, device=device)
    probability = torch.full_like(counts, float(1 - times[step + 1] / times[step]))
    return torch.binomial(counts, probability, generator=generator).long().tolist()


def filter_top_p_top_k(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """`logits` [..., V] with −∞ outside the tokens Dream's sampler may draw: the top-p nucleus of softmax(logits / τ)
    (the most probable tokens until their mass exceeds p; the first always kept), then the top-k of those. The
    logits themselves are not tempered (`propose_tokens` does that). top_p = 1 and top_k = 0 leave them unchanged."""
    if top_p >= 1 and top_k <= 0:
        return logits
    scaled = logits / temperature if temperature > 0 else logits
    if top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        beyond = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        beyond = torch.cat([torch.zeros_like(beyond[..., :1]), beyond[..., :-1]], dim=-1)
        scaled = scaled.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), -math.inf)
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return logits.masked_fill(scaled == -math.inf, -math.inf)


def perturb_scores_for_sampling(row_scores: torch.Tensor, position_temperature: float,
                                generator: torch.Generator | None) -> torch.Tensor:
    """row_scores / T + Gumbel noise: taking the top n of these draws n positions without replacement from
    softmax(row_scores / T) (Dream's ``alg_temp``, which draws them with ``torch.multinomial``); −∞ stays −∞."""
    uniform = torch.rand(row_scores.shape, generator=generator, device=row_scores.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
    return (row_scores.double() / position_temperature + gumbel).masked_fill(row_scores == -math.inf, -math.inf)


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


MAX_COMMITS_SCORED_AS_SET = 5
"""The most positions a step may commit when its choice is scored as a set (`committed_set_logprobs` sums over every
order of them: 5! = 120)."""


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


def draw_ranks(keys: torch.Tensor, commit: torch.Tensor) -> torch.LongTensor:
    """[B, Lb] the rank of each committed position by descending `keys` (0 = largest: drawn first), the positions
    after them for the others."""
    order = torch.where(commit, keys.double(), -math.inf).argsort(dim=1, descending=True, stable=True)
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ranks)


def parallel_commit_counts(
    scores: torch.Tensor, still_masked: torch.Tensor, threshold: float | None = None, factor: float | None = None
) -> torch.LongTensor:
    """[B] how many still-masked block positions to commit this step with parallel decoding.

    With c_(1) ≥ c_(2) ≥ … the row's scores over its still-masked positions (`scores` [B, Lb], `still_masked`
    [B, Lb]; under low_confidence remasking the scores are the candidates' probabilities), the count is the largest
    n with c_(n) > τ (`threshold`) or with (n + 1)(1 − c_(n)) < f (`factor`); at least 1 while the row has a
    masked position, 0 once its block is filled. Committing the top-n scores then commits exactly the positions
    above τ (Fast-dLLM's rule).
    """
    if (threshold is None) == (factor is None):
        raise ValueError("parallel_commit_counts needs exactly one of threshold and factor.")
    masked_counts = still_masked.sum(dim=1)
    ranked = scores.float().masked_fill(~still_masked, -math.inf).sort(dim=1, descending=True).values
    rank = torch.arange(1, ranked.shape[1] + 1, device=ranked.device)
    passes = ranked > threshold if threshold is not None else (rank + 1) * (1 - ranked) < factor
    passes &= rank <= masked_counts.unsqueeze(1)
    largest = (passes * rank).amax(dim=1)
    return torch.minimum(largest.clamp(min=1), masked_counts)


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.LongTensor:
    """A sample from softmax(logits / τ) over the last dim by the Gumbel-max trick; argmax of logits at τ = 0.

    With u ~ U(0, 1) drawn in float64 from `generator`, the official LLaDA form ``argmax_v exp(l_v) / (-log u_v)^τ``
    is evaluated through its logarithm, ``argmax_v l_v - τ log(-log u_v)``: the same argmax for the same u, without
    the overflow of exp(l) for large (e.g. guided) logits, and cheaper (no float64 exp or pow over the vocabulary).
    At τ = 0 no noise is drawn.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    noise = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    return noise.log_().neg_().log_().mul_(-temperature).add_(logits).argmax(dim=-1)


def sampling_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 log-prob of `tokens` under the distribution they were drawn from.

    ``log softmax(l / τ)[token] = l[token] / τ - logsumexp(l / τ)`` for τ > 0, and ``log softmax(l)[token]`` for
    τ = 0 (greedy decoding is scored by the untempered model distribution).
    """
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def masked_positions_first(still_masked: torch.Tensor, count: int) -> torch.LongTensor:
    """[B, count] indices into the block: each row's still-masked positions in ascending order, then committed ones."""
    return torch.sort((~still_masked).to(torch.uint8), dim=1, stable=True).indices[:, :count]


def _pad_equals_mask_problem(pad_token_id: int | None, mask_token_id: int | None) -> str | None:
    if pad_token_id is not None and pad_token_id == mask_token_id:
        return (
            f"pad_token_id equals mask_token_id ({mask_token_id}): padded prompt positions would be taken for masked "
            "positions and overwritten. Left-pad prompts with another id (LLaDA pads with its EOS id)."
        )
    return None


@dataclass
class DiffusionSamplerConfig:
    """Settings of the masked-diffusion sampler (LLaDA's `generate` arguments plus the behaviour-policy options).

    Attributes:
        gen_length: completion positions L; a multiple of `block_length`.
        block_length: positions per semi-autoregressive block (and per cache refresh).
        steps: denoising steps (= forward passes without CFG) in all; a multiple of the number of blocks. Unused with
            `threshold` or `factor`, where each block runs until it is filled.
        temperature: τ of the Gumbel-max candidate draw; 0 = greedy.
        remasking: which masked positions to commit: a name in `REMASKING_RULES` ("low_confidence", "random",
            "left_to_right") or a callable ``rule(block_logits, candidates, generator) -> scores`` (higher commits
            first).
        mask_token_id: the model's mask token (126336 for LLaDA-8B); None = ``model.config.mask_token_id``.
        eos_token_ids: tokens ending a completion (its mask runs through the first of them);
            empty = ``model.config.eos_token_id``.
        pad_token_id: the id prompts are left-padded with, checked to differ from the mask id;
            None = ``model.config.pad_token_id``.
        cfg_scale: classifier-free guidance s; logits = u + (s + 1)(c − u) with u from the prompt fully masked.
        cache: block KV cache: "none" (the official algorithm: every step a full forward), "prefix" (later steps of
            a block recompute the block and everything after it) or "dual" (they recompute the block only); the
            other positions' keys/values come from the block's first step. Needs a model whose forward takes
            ``past_key_values``, ``cache_position`` and ``use_cache`` as dllm_ais' LLaDA does.
        cache_refresh_interval: with a cache, also refresh it every this many steps inside a block (1 = every step,
            which is exactly the uncached algorithm); None = only at each block's first step.
        cache_dtype: storage of the cached keys/values while sampling: "none" (the model's dtype) or "fp8" (e4m3 with
            one scale per batch row and head, dequantized when read: dllm_ais.sampling.fp8_cache); `decoder_logits`
            replays with the cache in the model's dtype.
        threshold: parallel decoding: each step commits every still-masked block position whose score (the
            candidate's probability under low_confidence) exceeds τ_c, at least one (Fast-dLLM's rule).
        factor: parallel decoding: each step commits the largest n with (n + 1)(1 − c_(n)) < f, at least one.
            With either rule a block runs until it is filled and the steps taken vary per row.
        schedule: tokens committed per step of a block with the fixed schedule: "even" (LLaDA: the block's masked
            count split evenly over its steps, `transfer_schedule`) or "time_linear" (Dream: ⌊n (1 − t_{i+1}/t_i)⌋
            of the n still masked, t = linspace(1, `schedule_eps`, steps + 1), `time_linear_commit_count`).
            Steps at which no row commits a token run no forward.
        schedule_eps: ε, the last time of the time-linear schedule (Dream's ``eps``, 1e-3).
        top_p, top_k: the tokens a candidate may be drawn from: the top-p nucleus of softmax(logits / τ), then its
            top k (Dream's ``top_p`` / ``top_k``; `filter_top_p_top_k`); 1 and 0 = off. The remasking rule and the
            recorded log-probs see the filtered distribution (what was drawn from); the estimators score the
            unfiltered logits (`scoring_logits`, `decoder_logits`), so the trajectory ratio sees the filter as an
            approximation of the rollout, as TRL and verl score theirs.
        position_temperature: T > 0 makes the commit choice a draw with a recorded probability (the complete
            ratio, docs/algorithms.md): with a fixed count, the positions drawn from softmax(score / T) without
            replacement instead of the top scores (Dream's ``alg_temp``; Plackett–Luce); with `threshold`, each
            masked position committed with probability σ((score − threshold) / T), one drawn from softmax(score / T)
            when none is (`threshold_commits`). The rollout then records `choice_logprobs`, `commit_rank` and
            `discarded_candidates`. 0 = the deterministic rules (top scores; every score above the threshold).
        commit_choice_as_set: with a fixed count and T > 0, the choice's recorded log-probability is its set's
            (`committed_set_logprobs`: the draw order within the step summed out) instead of the drawn order's; at
            most `MAX_COMMITS_SCORED_AS_SET` commits a step, on the even schedule.
        logits_shifted: whether the model's logits at position i − 1 predict position i (Dream);
            None = from ``model.config.model_type`` (`dllm_ais.models.families`).
        block_causal: whether the model attends causally across blocks of ``model.config.block_size`` positions
            (SDAR: module docstring, "Block-causal models"); None = from ``model.config.model_type``.

    The cache and parallel decoding change the behaviour policy; the recorded log-probs stay those of the
    distribution each token was drawn from, and the correction treats the change like quantization.
    """

    gen_length: int = 256
    block_length: int = 32
    steps: int = 128
    temperature: float = 0.0
    remasking: str | RemaskingRule = "low_confidence"
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    cfg_scale: float = 0.0
    cache: str = "none"
    cache_refresh_interval: int | None = None
    cache_dtype: str = "none"
    threshold: float | None = None
    factor: float | None = None
    schedule: str = "even"
    schedule_eps: float = 1e-3
    top_p: float = 1.0
    top_k: int = 0
    position_temperature: float = 0.0
    commit_choice_as_set: bool = False
    logits_shifted: bool | None = None
    block_causal: bool | None = None

    @property
    def steps_per_block(self) -> int:
        """The fixed schedule's steps in each block: steps / (gen_length / block_length), at least 1."""
        return max(self.steps // max(self.gen_length // self.block_length, 1), 1)

    @property
    def max_commits_per_step(self) -> int:
        """The most positions one step of the even schedule commits: ⌈block_length / steps per block⌉."""
        return -(-self.block_length // self.steps_per_block)

    @property
    def parallel_decoding(self) -> bool:
        """True when a parallel-decoding rule (threshold or factor) replaces the fixed step schedule."""
        return self.threshold is not None or self.factor is not None

    def refreshes_cache(self, step_in_block: int) -> bool:
        """Whether the block cache is rebuilt at this forward of a block (0 = its first): at the first, and every
        `cache_refresh_interval` forwards after it (a step that commits nothing runs none)."""
        interval = self.cache_refresh_interval
        return step_in_block == 0 or (interval is not None and step_in_block % interval == 0)

    def exact(self) -> "DiffusionSamplerConfig":
        """These settings without the approximations: no cache, no parallel commits (the fixed schedule of `steps`)."""
        return dataclasses.replace(self, cache="none", cache_refresh_interval=None, cache_dtype="none", threshold=None,
                                   factor=None)

    def __post_init__(self) -> None:
        self.eos_token_ids = token_id_tuple(self.eos_token_ids)
        problems = [
            f"{name}={value} must be a positive integer"
            for name, value in (("gen_length", self.gen_length), ("block_length", self.block_length), ("steps", self.steps))
            if value <= 0
        ]
        if not problems and self.gen_length % self.block_length:
            problems.append(
                f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}: "
                "choose a block_length that divides gen_length"
            )
        if not problems and not self.parallel_decoding and self.steps % (self.gen_length // self.block_length):
            n_blocks = self.gen_length // self.block_length
            problems.append(
                f"steps={self.steps} is not a multiple of the number of blocks gen_length/block_length={n_blocks}: "
                f"use e.g. steps={max(n_blocks, self.steps // n_blocks * n_blocks)} or {(self.steps // n_blocks + 1) * n_blocks}"
            )
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy decoding)")
        if self.cfg_scale < 0:
            problems.append(f"cfg_scale={self.cfg_scale} must be >= 0 (0 = no classifier-free guidance)")
        if self.cache not in CACHE_MODES:
            problems.append(f"cache={self.cache!r}: choose one of {', '.join(CACHE_MODES)}")
        if self.cache_refresh_interval is not None and (
            isinstance(self.cache_refresh_interval, bool) or not isinstance(self.cache_refresh_interval, int)
            or self.cache_refresh_interval < 1
        ):
            problems.append(f"cache_refresh_interval={self.cache_refresh_interval!r} must be a positive int or None")
        if self.cache_dtype not in CACHE_DTYPES:
            problems.append(f"cache_dtype={self.cache_dtype!r}: choose one of {', '.join(CACHE_DTYPES)}")
        elif self.cache_dtype != "none" and self.cache == "none":
            problems.append(f"cache_dtype={self.cache_dtype!r} stores the block KV cache: set cache to prefix or dual")
        if self.threshold is not None and self.factor is not None:
            problems.append("threshold and factor are two parallel-decoding rules: set one of them")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            problems.append(f"threshold={self.threshold} must be a confidence in [0, 1] (Fast-dLLM uses 0.9)")
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor > 0):
            problems.append(f"factor={self.factor} must be a finite number > 0 (Fast-dLLM uses 1.0)")
        if self.schedule not in COMMIT_SCHEDULES:
            problems.append(f"schedule={self.schedule!r}: choose one of {', '.join(COMMIT_SCHEDULES)}")
        if not 0 < self.schedule_eps < 1:
            problems.append(f"schedule_eps={self.schedule_eps} must be in (0, 1) (Dream uses 1e-3)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (math.isfinite(self.position_temperature) and self.position_temperature >= 0):
            problems.append(f"position_temperature={self.position_temperature} must be >= 0 (0 = top scores)")
        if self.commit_choice_as_set and not (self.position_temperature > 0 and not self.parallel_decoding
                                              and self.schedule == "even"
                                              and self.max_commits_per_step <= MAX_COMMITS_SCORED_AS_SET):
            problems.append("commit_choice_as_set scores a fixed count's drawn positions as a set: it needs "
                            "position_temperature > 0, no threshold or factor, the even schedule and at most "
                            f"{MAX_COMMITS_SCORED_AS_SET} commits a step (block_length / steps per block)")
        if self.remasking == "top_log_odds" and self.parallel_decoding:
            problems.append("remasking='top_log_odds' scores log-odds, which a threshold or factor on a confidence in "
                            "[0, 1] does not read: use top_probability with parallel decoding")
        if self.remasking == "origin":
            if self.parallel_decoding:
                problems.append("remasking='origin' commits a random number of positions per step: it takes no "
                                "threshold or factor")
            if self.cache_refresh_interval is not None:
                problems.append("remasking='origin' may commit nothing in a row for several steps, which a cache "
                                "refreshed every cache_refresh_interval steps cannot replay: leave the interval unset")
        pad_problem = _pad_equals_mask_problem(self.pad_token_id, self.mask_token_id)
        if pad_problem:
            problems.append(pad_problem)
        if self.block_causal:
            problems.extend(self.block_causal_problems())
        if problems:
            raise ValueError("Invalid DiffusionSamplerConfig: " + "; ".join(problems) + ".")
        resolve_remasking_rule(self.remasking)

    def block_causal_problems(self) -> list[str]:
        """The settings a block-causal model's decoding does not take (module docstring, "Block-causal models")."""
        problems = []
        if self.cfg_scale > 0:
            problems.append("cfg_scale > 0: classifier-free guidance is not defined for a block-causal model")
        if self.cache_dtype != "none":
            problems.append(f"cache_dtype={self.cache_dtype!r}: a block-causal model's cache of finished blocks is "
                            "kept in the model's dtype")
        if self.cache_refresh_interval is not None:
            problems.append("cache_refresh_interval: a block-causal model's cache is exact and never refreshed")
        if self.threshold is not None and self.position_temperature > 0:
            problems.append("threshold with position_temperature > 0 is not implemented for a block-causal model")
        n_blocks = self.gen_length // self.block_length
        if self.parallel_decoding and self.steps % n_blocks:
            problems.append(f"steps={self.steps} is not a multiple of the number of blocks {n_blocks}: a block-causal "
                            "model's parallel decoding commits at least the per-block schedule of steps / blocks steps")
        return problems


@dataclass(frozen=True)
class SpecialTokenIds:
    """The token ids a sampling run uses, resolved from the sampler config with the model config as fallback, and
    whether the model's logits at position i − 1 predict position i (`logits_shifted`, Dream) and whether it attends
    causally across blocks (`block_causal`, SDAR)."""

    mask: int
    eos: tuple[int, ...]
    logits_shifted: bool = False
    block_causal: bool = False


def _checked_scores(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The remasking rule's scores as a floating tensor (−∞ marks unavailable positions), after a shape check."""
    if scores.shape != candidates.shape:
        raise ValueError(
            f"The remasking rule returned scores of shape {tuple(scores.shape)}; it must return one score per block "
            f"position, shape {tuple(candidates.shape)} like its `candidates` argument."
        )
    return scores if scores.is_floating_point() else scores.float()


@dataclass(frozen=True)
class CanvasLayout:
    """Where one sampling call's prompts and completions sit on its canvas.

    canvas [B, T]: the prompt tokens, the mask id at every completion position, padding elsewhere; attention [B, T]
    (1 = a real token) or None when no row is padded; completion_index [B, L]: the canvas position of each completion
    position; blocks: the canvas slices decoded in turn; prompt_length: the canvas positions before the first block
    (classifier-free guidance masks them).

    LLaDA and Dream decode `completion_layout` (the left-padded prompts, then the completion); a block-causal model
    decodes `block_aligned_layout`.
    """

    canvas: torch.Tensor
    attention: torch.Tensor | None
    completion_index: torch.LongTensor
    blocks: list[slice]
    prompt_length: int

    def completion(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [B, T, ...] laid out on the canvas, read at the completion positions: [B, L, ...]."""
        index = self.completion_index.view(*self.completion_index.shape, *[1] * (values.dim() - 2))
        return values.gather(1, index.expand(-1, -1, *values.shape[2:]))

    def on_canvas(self, values: torch.Tensor, fill: int | float | bool) -> torch.Tensor:
        """`values` [B, L] of the completion positions laid out on the canvas [B, T], `fill` elsewhere."""
        return values.new_full(self.canvas.shape, fill).scatter(1, self.completion_index, values)

    def completion_window(self, block: slice) -> slice | torch.LongTensor:
        """The completion positions of the canvas slice `block`: a slice when every row's completion starts at the same
        canvas position, else [B, Lb] indices, −1 where a row's position in the block is not a completion position
        (its prompt's tail, or past its completion)."""
        starts = self.completion_index[:, 0]
        if bool((starts == self.prompt_length).all()):
            return slice(block.start - self.prompt_length, block.stop - self.prompt_length)
        index = torch.arange(block.start, block.stop, device=starts.device) - starts[:, None]
        return index.masked_fill((index < 0) | (index >= self.completion_index.shape[1]), -1)


def completion_window(values: torch.Tensor, window: slice | torch.LongTensor) -> torch.Tensor:
    """`values` [B, L, ...] at a block's completion positions (`CanvasLayout.completion_window`): ``values[:, window]``
    for a slice; gathered at the [B, Lb] indices otherwise, position 0's value where the index is −1."""
    if isinstance(window, slice):
        return values[:, window]
    index = window.clamp_min(0).view(*window.shape, *[1] * (values.dim() - 2))
    return values.gather(1, index.expand(-1, -1, *values.shape[2:]))


def completion_layout(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, gen_length: int,
                      block_length: int, mask_id: int) -> CanvasLayout:
    """The canvas ``[left-padded prompts | MASK × gen_length]``, decoded in blocks of `block_length` from the
    prompts' end."""
    batch, prompt_length = input_ids.shape
    canvas = torch.cat([input_ids, input_ids.new_full((batch, gen_length), mask_id)], dim=1)
    attention = padding_or_none(attention_mask)
    if attention is not None:
        attention = torch.cat([attention, attention.new_ones((batch, gen_length))], dim=1)
    completion_index = prompt_length + torch.arange(gen_length, device=input_ids.device).expand(batch, -1)
    blocks = [slice(start, start + block_length) for start in range(prompt_length, prompt_length + gen_length,
                                                                    block_length)]
    return CanvasLayout(canvas, attention, completion_index, blocks, prompt_length)


def block_aligned_layout(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, gen_length: int,
                         block_length: int, mask_id: int, padding_id: int) -> CanvasLayout:
    """A block-causal model's canvas: each left-padded prompt moved so that its real tokens start at a multiple of
    `block_length`, hence every row's blocks (counted from its first real token) at the same canvas slices.

    With P the prompts' padded width, n_b ≤ P real prompt tokens in row b and J = ⌊P / block_length⌋, row b's
    completion starts at s_b = J·block_length + (n_b mod block_length), inside the first decoded block J, and its
    prompt at s_b − n_b (a multiple of `block_length`); the canvas holds (J + 1)·block_length + `gen_length`
    positions (one shape per prompt width, as the compiled engine's graphs want), `padding_id` (attention 0) before
    each prompt and after each completion. The blocks are the slices of `block_length` from J·block_length on; a
    block past every row's completion is left without a forward.
    """
    batch, width = input_ids.shape
    device = input_ids.device
    lengths = (attention_mask.long().sum(dim=1) if attention_mask is not None
               else torch.full((batch,), width, device=device))
    first_block = width // block_length
    completion_start = first_block * block_length + lengths % block_length
    total = (first_block + 1) * block_length + gen_length
    positions = torch.arange(total, device=device).expand(batch, -1)
    in_prompt = (positions >= (completion_start - lengths)[:, None]) & (positions < completion_start[:, None])
    in_completion = (positions >= completion_start[:, None]) & (positions < (completion_start + gen_length)[:, None])
    source = (positions + (width - completion_start)[:, None]).clamp(0, width - 1)
    canvas = torch.where(in_prompt, input_ids.gather(1, source), padding_id).masked_fill(in_completion, mask_id)
    attention = (in_prompt | in_completion).to(attention_mask.dtype if attention_mask is not None else torch.long)
    completion_index = completion_start[:, None] + torch.arange(gen_length, device=device)
    blocks = [slice(start, start + block_length) for start in range(first_block * block_length, total, block_length)]
    return CanvasLayout(canvas, padding_or_none(attention), completion_index, blocks, first_block * block_length)


BLOCK_CAUSAL_CACHE = "block_causal"
"""`BlockCache.mode` of a block-causal model's exact cache of finished blocks (whatever `config.cache` names)."""


@dataclass
class BlockCache:
    """The block KV cache of one `sample` call: the model's cached keys/values and whether the next forward refreshes
    them (the first step of each block, and every `cache_refresh_interval` steps).

    mode: "prefix" or "dual"; dtype: the storage, "none" (as the model returns it) or "fp8" (`FP8KeyValueCache`);
    past_key_values: what the last refreshing forward returned, so stored.

    mode `BLOCK_CAUSAL_CACHE` is a block-causal model's exact cache instead (`block_causal_forward`): never
    refreshed; `stored_until` is the canvas position up to which it holds the keys/values of finished blocks.
    """

    mode: str
    dtype: str = "none"
    past_key_values: Any = None
    refresh: bool = True
    stored_until: int = 0

    def block_forward(
        self, model: Any, inputs: torch.Tensor, attention_mask: torch.Tensor | None, block: slice,
        logits_shifted: bool = False,
    ) -> torch.Tensor:
        """Logits [B, Lb, V] predicting the `block` positions of `inputs` [B, T] (for a shifted family, those computed
        one position earlier: `dllm_ais.models.families`).

        A refreshing forward runs the whole canvas and keeps its keys/values (its logits, computed at the block only,
        are those of the uncached forward). Otherwise the model runs on positions [start, T) (prefix) or
        [start, block.stop) (dual) only, at their absolute positions, attending to the cached keys/values elsewhere;
        start is block.start, or block.start − 1 for a shifted family, whose first block position is predicted there.
        """
        if self.mode == BLOCK_CAUSAL_CACHE:
            return self.block_causal_forward(model, inputs, attention_mask, block)
        positions = torch.arange(block.start, block.stop, device=inputs.device)
        sources = logit_source_positions(positions, logits_shifted)
        forwards = static_forwards_of(model)
        if self.refresh:
            self.past_key_values = None  # frees the previous block's cache before the new one is built
            if forwards is not None:
                self.past_key_values, logits = forwards.key_value_buffers(inputs, attention_mask, sources, self.dtype)
                return logits
            output = model(inputs, attention_mask=attention_mask, use_cache=True, logits_to_keep=sources)
            self.past_key_values = (FP8KeyValueCache(output.past_key_values) if self.dtype == "fp8"
                                    else output.past_key_values)
            return output.logits
        start = block.start - 1 if logits_shifted else block.start
        stop = inputs.shape[1] if self.mode == "prefix" else block.stop
        cached = {"attention_mask": attention_mask, "logits_to_keep": sources - start,
                  "past_key_values": self.past_key_values,
                  "cache_position": torch.arange(start, stop, device=inputs.device)}
        if forwards is not None:
            return forwards.logits(inputs[:, start:stop], **cached)
        return model(inputs[:, start:stop], **cached).logits

    def block_causal_forward(self, model: Any, inputs: torch.Tensor, attention_mask: torch.Tensor | None,
                             block: slice) -> torch.Tensor:
        """Logits [B, Lb, V] of the `block` positions of a block-causal model's canvas `inputs` [B, T], every position
        before `block` holding its final token (the blocks are decoded in order).

        The first call runs positions [0, block.stop) and keeps their keys/values in buffers of the canvas length
        (the later positions zero until written: a block never attends to later blocks); with the rollout engine's
        static forwards, it runs the whole canvas into the engine's buffers of that shape instead (the later
        positions then hold keys/values of masks, rewritten before a later block reads them), and every call replays
        a captured forward. Every later call runs
        [`stored_until`, block.stop) against the buffers, writing those positions: the current block alone, or, at a
        block's first step, also the block finished before it, whose clean keys/values are stored so. The block's
        own keys/values, written while it is still masked, are rewritten by the next block's first forward before
        any later block reads them; the logits are those of the full block-causal forward. Under grad (a replay)
        the model writes into copies of the buffers, which the cache keeps instead.
        """
        positions = torch.arange(block.start, block.stop, device=inputs.device)
        forwards = static_forwards_of(model)
        if self.past_key_values is None and forwards is not None:  # the engine's buffers, written over the canvas
            self.past_key_values, logits = forwards.key_value_buffers(inputs, attention_mask, positions)
        elif self.past_key_values is None:
            stop = block.stop
            output = model(inputs[:, :stop], attention_mask=None if attention_mask is None else attention_mask[:, :stop],
                           use_cache=True, logits_to_keep=positions)
            room = inputs.shape[1] - stop
            self.past_key_values = [tuple(F.pad(tensor, (0, 0, 0, room)) for tensor in layer)
                                    for layer in output.past_key_values]
            logits = output.logits
        else:
            start = self.stored_until
            cached = {"attention_mask": attention_mask, "logits_to_keep": positions - start,
                      "past_key_values": self.past_key_values,
                      "cache_position": torch.arange(start, block.stop, device=inputs.device)}
            if forwards is not None:
                logits = forwards.logits(inputs[:, start:block.stop], **cached)
            else:
                output = model(inputs[:, start:block.stop], use_cache=True, **cached)
                self.past_key_values = output.past_key_values  # the buffers, or their written copy under grad
                logits = output.logits
        self.stored_until = block.start
        return logits


@dataclass
class _ChoiceRecord:
    """What a sampling call with a stochastic commit rule (``position_temperature`` > 0) records of its choices
    besides the committed tokens, as the `Rollout` fields of the same names, per canvas position [B, T] until
    `fields` reads them at the completion's: `choice_logprobs` (each step's
    `MaskedDiffusionSampler.step_choice_logprobs`, added up per position), `commit_rank` (the draw order among a
    step's commits) and, when the sampler's ratio needs them (`records_discarded_candidates`),
    `discarded_candidates` [B, T, block_length] (the candidate drawn at a position at the k-th forward of its block
    and left uncommitted, −1 where none)."""

    choice_logprobs: torch.Tensor
    commit_rank: torch.LongTensor
    discarded_candidates: torch.LongTensor | None

    @classmethod
    def empty(cls, shape: torch.Size, sampler: "MaskedDiffusionSampler", device: torch.device) -> "_ChoiceRecord":
        discarded = (torch.full((*shape, sampler.config.block_length), -1, dtype=torch.long, device=device)
                     if sampler.records_discarded_candidates else None)
        return cls(torch.zeros(shape, dtype=torch.float32, device=device),
                   torch.zeros(shape, dtype=torch.long, device=device), discarded)

    def add_step(self, sampler: "MaskedDiffusionSampler", block: slice, forward_in_block: int,
                 logits: torch.Tensor, scores: torch.Tensor, still_masked: torch.Tensor, commit: torch.Tensor,
                 commit_rank: torch.Tensor | None, candidates: torch.Tensor, candidate_logprobs: torch.Tensor) -> None:
        """Record one step of the canvas block `block` (its `forward_in_block`-th forward, from 0)."""
        self.choice_logprobs[:, block] += sampler.step_choice_logprobs(
            logits, scores, still_masked, commit, commit_rank, candidate_logprobs)
        if commit_rank is not None:
            self.commit_rank[:, block] = torch.where(commit, commit_rank, self.commit_rank[:, block])
        if self.discarded_candidates is not None:
            self.discarded_candidates[:, block, forward_in_block] = torch.where(still_masked & ~commit, candidates, -1)

    def fields(self, layout: CanvasLayout) -> dict[str, torch.Tensor | None]:
        """The records at the completion positions of `layout`, by field name."""
        return {field.name: None if getattr(self, field.name) is None else layout.completion(getattr(self, field.name))
                for field in dataclasses.fields(self)}


class CommitChoiceReplay:
    """The log-probability terms [B, L] of a rollout's recorded commit choices (and discarded candidates, when the
    ratio holds them), one replayed step at a time: called with each ``(block, committed, logits)`` that
    `MaskedDiffusionSampler.decoder_logits` yields, in order, it returns that step's `step_choice_logprobs` of the
    recorded choice (`Rollout.commit_rank`, `discarded_candidates`) on the completion's positions, 0 elsewhere. The
    rule scores the step's `logits` as sampling did (top-p / top-k filtered), so the terms are differentiable in
    them: the trainer's log-prob of the commit choice, from the logits the trajectory estimator scores."""

    def __init__(self, sampler: "MaskedDiffusionSampler", rollout: Rollout):
        if rollout.commit_rank is None or (sampler.records_discarded_candidates
                                           and rollout.discarded_candidates is None):
            raise ValueError("The commit choice's log-prob needs a rollout that records its commit choices: sample "
                             "with position_temperature > 0 (experimental.rollout_position_temperature)")
        self.sampler, self.rollout = sampler, rollout
        self.block, self.still_masked, self.step = None, None, 0

    def __call__(self, window: slice | torch.LongTensor, committed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        sampler, rollout = self.sampler, self.rollout
        config, completion = sampler.config, rollout.completion_ids
        if window is not self.block:  # a new block: every completion position in it masked
            self.block, self.step = window, 0
            self.still_masked = torch.ones_like(committed) if isinstance(window, slice) else window >= 0
        logits = filter_top_p_top_k(logits, config.temperature, config.top_p, config.top_k)
        candidates = completion_window(completion, window)
        if sampler.records_discarded_candidates:
            discarded = completion_window(rollout.discarded_candidates[:, :, self.step], window)
            candidates = torch.where(committed | (discarded < 0), candidates, discarded)
        scores = sampler.rule_scores(logits, candidates, None) if sampler.commit_choice_depends_on_model else None
        terms = sampler.step_choice_logprobs(logits, scores, self.still_masked, committed,
                                             completion_window(rollout.commit_rank, window),
                                             sampler.token_logprobs(logits, candidates))
        self.still_masked = self.still_masked & ~committed
        self.step += 1
        if isinstance(window, slice):
            start = window.start or 0
            return F.pad(terms, (start, completion.shape[1] - start - terms.shape[1]))
        placed = torch.zeros(completion.shape, dtype=terms.dtype, device=terms.device)
        return placed.scatter_add(1, window.clamp_min(0), torch.where(window >= 0, terms, 0.0))


def _max_canvas_length(model: Any) -> float:
    """The longest canvas the model takes (its config's max_sequence_length or max_position_embeddings; inf when it
    names neither)."""
    model_config = getattr(model, "config", None)
    return (getattr(model_config, "max_sequence_length", None) or getattr(model_config, "max_position_embeddings", None)
            or math.inf)


def _forward_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: slice | torch.Tensor,
    logits_shifted: bool = False,
) -> torch.Tensor:
    """Logits [B, K, V] predicting `positions`, a slice (sampling: the current block) or a 1-D position tensor
    (scoring), passed to the model as ``logits_to_keep`` so that the LM head runs at those positions only; for a
    shifted family one position earlier (`dllm_ais.models.families.logit_source_positions`; a completion block
    starts after the prompt, so its predecessor exists). A sampling forward of the rollout engine's model runs
    through its static forwards when it has them (`dllm_ais.sampling.static_forwards`)."""
    forwards = None
    if isinstance(positions, slice):
        positions = torch.arange(positions.start, positions.stop, device=input_ids.device)
        forwards = static_forwards_of(model)
    sources = logit_source_positions(positions, logits_shifted)
    if forwards is not None:
        return forwards.logits(input_ids, attention_mask, sources)
    output = model(input_ids, attention_mask=attention_mask, logits_to_keep=sources)
    return output.logits if hasattr(output, "logits") else output


class MaskedDiffusionSampler:
    """The LLaDA masked-diffusion sampler, returning a `Rollout` with per-step unmasking log-probs.

    Usage::

        sampler = MaskedDiffusionSampler(DiffusionSamplerConfig(gen_length=256, block_length=32, steps=128,
                                                                temperature=0.9, mask_token_id=126336))
        rollout = sampler.sample(model, input_ids, attention_mask, generator=torch.Generator("cuda").manual_seed(0))

    To change one stage of a step, subclass and override `block_logits`, `propose_tokens` or `choose_positions`
    (see the module docstring for what the trainer requires of a subclass).
    """

    def __init__(self, config: DiffusionSamplerConfig):
        self.config = config
        self.remasking_rule = resolve_remasking_rule(config.remasking)

    def resolve_token_ids(self, model: Any) -> SpecialTokenIds:
        """Mask and EOS ids from the sampler config, falling back to ``model.config``; raises when they are missing
        or when the pad id (config, else model config) equals the mask id."""
        model_config = getattr(model, "config", None)
        mask = self.config.mask_token_id
        if mask is None:
            mask = getattr(model_config, "mask_token_id", None)
        if mask is None:
            raise ValueError(
                "No mask token id: set DiffusionSamplerConfig(mask_token_id=...) (126336 for LLaDA-8B) "
                "or model.config.mask_token_id."
            )
        eos = self.config.eos_token_ids or token_id_tuple(getattr(model_config, "eos_token_id", None))
        if not eos:
            raise ValueError(
                "No EOS token id, so completions could not be cut at their end: set "
                "DiffusionSamplerConfig(eos_token_ids=(...)) or model.config.eos_token_id."
            )
        pad = self.config.pad_token_id
        if pad is None:
            pad = getattr(model_config, "pad_token_id", None)
        pad_problem = _pad_equals_mask_problem(pad, mask)
        if pad_problem:
            raise ValueError(pad_problem)
        shifted = self.config.logits_shifted
        block_causal = is_block_causal(model) if self.config.block_causal is None else self.config.block_causal
        if block_causal:
            block_size = getattr(model_config, "block_size", None)
            problems = self.config.block_causal_problems()
            if block_size is not None and block_size != self.config.block_length:
                problems.append(f"block_length={self.config.block_length} differs from the model's block_size="
                                f"{block_size}: set rollout.block_length to {block_size}")
            if problems:
                raise ValueError("This sampler cannot decode a block-causal model: " + "; ".join(problems) + ".")
        return SpecialTokenIds(mask=int(mask), eos=eos,
                               logits_shifted=logits_are_shifted(model) if shifted is None else shifted,
                               block_causal=block_causal)

    def check_inputs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generator: torch.Generator | None,
        token_ids: SpecialTokenIds,
    ) -> None:
        """Raise ValueError, before any forward pass, for prompts this sampler cannot complete."""
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be a [batch, prompt_length] integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}.")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}: "
                "pass the mask the tokenizer returned with the left-padded prompts."
            )
        max_length = _max_canvas_length(model)
        canvas_length = self.canvas_length(input_ids.shape[1], token_ids)
        if canvas_length > max_length:
            raise PromptError(
                f"prompt length {input_ids.shape[1]} + gen_length {self.config.gen_length} (a canvas of {canvas_length} "
                f"positions) exceeds the model's max_sequence_length={max_length}: truncate the prompts or lower "
                "gen_length."
            )
        if token_ids.block_causal and attention_mask is not None and bool((attention_mask.diff(dim=1) < 0).any()):
            raise ValueError("A block-causal model's prompts must be left-padded (attention_mask 0…0 1…1 per row): "
                             "tokenize them with padding_side='left'.")
        rows_with_mask = (input_ids == token_ids.mask).any(dim=1).nonzero().flatten().tolist()
        if rows_with_mask:
            raise PromptError(
                f"Prompts {rows_with_mask} contain the mask token id {token_ids.mask}, which the sampler would overwrite: "
                "remove it from the prompt text or check that mask_token_id is the model's mask token."
            )
        if generator is not None and generator.device.type != input_ids.device.type:
            raise ValueError(
                f"The generator is on {generator.device} but the prompts are on {input_ids.device}: create it with "
                f"torch.Generator(device={input_ids.device.type!r})."
            )

    @torch.no_grad()
    def sample(
        self,
        model: Any,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """Complete left-padded prompts `input_ids` [B, P] by masked diffusion; all randomness from `generator`.

        `attention_mask` [B, P] marks real prompt tokens (1) against padding (0); it is extended with ones over the
        completion and given to every forward. Without it the model attends to every position, as LLaDA does.
        """
        return self._denoise(model, input_ids, attention_mask, generator)

    @torch.no_grad()
    def replay(self, model: Any, rollout: Rollout, generator: torch.Generator | None = None) -> Rollout:
        """The order in which this sampler would commit `rollout`'s completion tokens, teacher-forced.

        The denoising loop runs with this sampler's stages (logits, cache, remasking rule, schedule or parallel
        rule) but every candidate is the token the completion already holds, scored by `token_logprobs`. The result
        has the same sequences, with `commit_step`, `step_logprobs` and `num_steps` of this sampler's order: e.g. a
        fast-sampled completion replayed along the exact decoder's order (low confidence under `model`'s logits,
        ``steps`` commits on its fixed schedule), so a trajectory-type estimator trains at the canvas states that
        decoder visits.
        """
        attention_mask = rollout.attention_mask[:, :rollout.prompt_length]
        replayed = self._denoise(model, rollout.prompt_ids, attention_mask, generator, rollout.completion_ids)
        return dataclasses.replace(replayed, completion_mask=rollout.completion_mask)

    def _denoise(
        self,
        model: Any,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        generator: torch.Generator | None,
        forced_completion: torch.LongTensor | None = None,
    ) -> Rollout:
        """The denoising loop of `sample`; with `forced_completion` [B, L] its candidates are those tokens. A model with
        static forwards (`dllm_ais.sampling.static_forwards`) gets its prompts left-padded to a length bucket first,
        and the padding is cut off the rollout."""
        token_ids = self.resolve_token_ids(model)
        self.check_inputs(model, input_ids, attention_mask, generator, token_ids)
        bucket_padding = 0
        if static_forwards_of(model) is not None:  # static shapes: prompts left-padded to a length bucket
            bucket_padding = bucketed_prompt_length(input_ids.shape[1]) - input_ids.shape[1]
            if self.canvas_length(input_ids.shape[1] + bucket_padding, token_ids) > _max_canvas_length(model):
                bucket_padding = 0
            if bucket_padding:
                real = torch.ones_like(input_ids) if attention_mask is None else attention_mask
                attention_mask = F.pad(real, (bucket_padding, 0), value=0)
                input_ids = F.pad(input_ids, (bucket_padding, 0), value=token_ids.eos[0])
        rollout = self._denoise_canvas(model, input_ids, attention_mask, generator, token_ids, forced_completion)
        if not bucket_padding:
            return rollout
        return dataclasses.replace(
            rollout, sequences=rollout.sequences[:, bucket_padding:],
            attention_mask=rollout.attention_mask[:, bucket_padding:], prompt_length=rollout.prompt_length - bucket_padding)

    def canvas_length(self, prompt_length: int, token_ids: SpecialTokenIds) -> int:
        """The canvas length of `canvas_layout` for prompts `prompt_length` wide: prompt + completion, up to a block
        more for a block-causal model (`block_aligned_layout`)."""
        block = self.config.block_length
        if token_ids.block_causal:
            return (prompt_length // block + 1) * block + self.config.gen_length
        return prompt_length + self.config.gen_length

    def canvas_layout(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                      token_ids: SpecialTokenIds) -> CanvasLayout:
        """The canvas a sampling or replay call of these prompts decodes: `block_aligned_layout` for a block-causal
        model, `completion_layout` otherwise."""
        config = self.config
        if token_ids.block_causal:
            return block_aligned_layout(input_ids, attention_mask, config.gen_length, config.block_length,
                                        token_ids.mask, token_ids.eos[0])
        return completion_layout(input_ids, attention_mask, config.gen_length, config.block_length, token_ids.mask)

    def block_cache(self, token_ids: SpecialTokenIds, sampling: bool = True) -> BlockCache | None:
        """A fresh cache for one sampling call (`sampling`, in `config.cache_dtype`) or replay (in the model's dtype):
        a block-causal model's exact cache whatever the mode, none with ``cache="none"``."""
        if self.config.cache == "none":
            return None
        if token_ids.block_causal:
            return BlockCache(BLOCK_CAUSAL_CACHE)
        return BlockCache(self.config.cache, self.config.cache_dtype if sampling else "none")

    def _denoise_canvas(
        self,
        model: Any,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        generator: torch.Generator | None,
        token_ids: SpecialTokenIds,
        forced_completion: torch.LongTensor | None,
    ) -> Rollout:
        """The denoising loop over the canvas of `canvas_layout` (``[input_ids | MASK x gen_length]`` but for a
        block-causal model), its records mapped back to the rollout's ``[input_ids | completion]``.

        Host synchronisation: none per step with the fixed schedules (every row of a fresh block holds
        `block_length` masked positions, so the counts are known on the host), except ``origin``'s random counts;
        one per step with parallel decoding (its data-dependent counts, which also tell when a block is filled); one
        per block for a block-causal model (its rows' masked positions in the block)."""
        config = self.config
        batch = input_ids.shape[0]
        device = input_ids.device
        layout = self.canvas_layout(input_ids, attention_mask, token_ids)
        canvas = layout.canvas
        forced_canvas = None if forced_completion is None else layout.on_canvas(forced_completion, token_ids.mask)
        step_logprobs = torch.zeros(canvas.shape, dtype=torch.float32, device=device)
        commit_step = torch.full(canvas.shape, -1, dtype=torch.long, device=device)
        num_steps = torch.zeros(batch, dtype=torch.long, device=device)
        cache = self.block_cache(token_ids)
        choice = _ChoiceRecord.empty(canvas.shape, self, device) if config.position_temperature > 0 else None

        rows = torch.arange(batch, device=device).unsqueeze(1)
        steps_per_block = config.steps_per_block
        block_schedule = transfer_schedule(torch.tensor([config.block_length]), steps_per_block)[0].tolist()
        step = 0  # global step index, shared by the rows (they step in lockstep)
        # Per block, per row, its masked positions (fewer than block_length in a block-causal model's first and last
        # blocks): read once, before the loop, so that no block waits on the device for them.
        masked_per_block = ([[config.block_length] * batch] * len(layout.blocks) if not token_ids.block_causal else
                            torch.stack([canvas[:, block] == token_ids.mask for block in layout.blocks], dim=1)
                            .sum(dim=2).T.tolist())
        for block, masked_left in zip(layout.blocks, masked_per_block):
            still_masked = canvas[:, block] == token_ids.mask
            step_in_block = forwards_in_block = 0
            while step_in_block < steps_per_block if not config.parallel_decoding else max(masked_left) > 0:
                scheduled = None  # the fixed schedule's counts (a block-causal model's floor with parallel decoding)
                if not config.parallel_decoding or token_ids.block_causal:
                    scheduled = self._scheduled_counts(masked_left, block_schedule, step_in_block, steps_per_block,
                                                       generator)
                counts = None if config.parallel_decoding else scheduled
                step_in_block += 1
                if counts is not None and max(counts) == 0:
                    continue  # the official loops run a forward here that commits nothing
                if cache is not None:
                    cache.refresh = config.refreshes_cache(forwards_in_block)
                forwards_in_block += 1
                logits = self.block_logits(model, canvas, layout.attention, layout.prompt_length, block, token_ids,
                                           cache)
                logits = filter_top_p_top_k(logits, config.temperature, config.top_p, config.top_k)
                # Tokens are drawn only for still-masked positions, gathered to the front of a [B, M, V] tensor.
                active = masked_positions_first(still_masked, max(masked_left))
                if forced_canvas is None:
                    drawn, drawn_logprobs = self.propose_tokens(logits[rows, active], generator)
                else:
                    drawn = forced_canvas[:, block].gather(1, active)
                    drawn_logprobs = self.token_logprobs(logits[rows, active], drawn)
                candidates = canvas[:, block].scatter(1, active, drawn)
                scores = self.rule_scores(logits, candidates, generator)
                commit_rank = None
                if config.threshold is not None and config.position_temperature > 0:
                    commit = threshold_commits(scores, self.forced_commit_scores(logits, scores), still_masked,
                                               config.threshold, config.position_temperature, generator)
                    counts = commit.sum(dim=1).tolist()
                else:
                    if counts is None:
                        counts = parallel_commit_counts(scores, still_masked, config.threshold, config.factor).tolist()
                        if token_ids.block_causal:  # SDAR's low_confidence_dynamic: at least the step's count
                            counts = list(map(max, counts, scheduled))
                    row_scores = scores.new_full(canvas.shape, -math.inf)
                    row_scores[:, block] = scores.masked_fill(~still_masked, -math.inf)
                    if config.position_temperature > 0:
                        row_scores = perturb_scores_for_sampling(row_scores, config.position_temperature, generator)
                    commit = self.choose_positions(row_scores, counts)[:, block] & still_masked
                    if choice is not None:
                        commit_rank = draw_ranks(row_scores[:, block], commit)
                logprobs = torch.zeros_like(step_logprobs[:, block]).scatter(1, active, drawn_logprobs)
                if choice is not None:
                    choice.add_step(self, block, forwards_in_block - 1, logits, scores, still_masked, commit,
                                    commit_rank, candidates, logprobs)
                canvas[:, block] = torch.where(commit, candidates, canvas[:, block])
                step_logprobs[:, block] = torch.where(commit, logprobs, step_logprobs[:, block])
                commit_step[:, block].masked_fill_(commit, step)
                num_steps += commit.any(dim=1)
                still_masked &= ~commit
                masked_left = [max(left - count, 0) for left, count in zip(masked_left, counts)]
                step += 1

        completion = layout.completion(canvas)
        sequences = torch.cat([input_ids, completion], dim=1)
        prompt_attention = padding_or_none(attention_mask)
        return Rollout(
            sequences=sequences,
            attention_mask=(torch.ones_like(sequences) if prompt_attention is None else
                            torch.cat([prompt_attention, prompt_attention.new_ones(completion.shape)], dim=1)),
            completion_mask=completion_mask_through_first_eos(completion, token_ids.eos),
            step_logprobs=layout.completion(step_logprobs),
            commit_step=layout.completion(commit_step),
            prompt_length=input_ids.shape[1],
            num_steps=num_steps,
            **({} if choice is None else choice.fields(layout)),
        )

    def _scheduled_counts(self, masked_left: list[int], block_schedule: list[int], step_in_block: int,
                          steps_per_block: int, generator: torch.Generator | None) -> list[int]:
        """Per row, the tokens the fixed schedule commits at this step of the block: Binomial for ``origin``
        (`origin_commit_counts`), else the `config.schedule`'s count: ``time_linear``'s of the masked positions left,
        or the even split of a whole block over its steps (`block_schedule`, `transfer_schedule`), at most the masked
        positions left (a block-causal model's first and last blocks hold fewer than block_length)."""
        config = self.config
        if config.remasking == "origin":
            return origin_commit_counts(masked_left, step_in_block, steps_per_block, config.schedule_eps, generator)
        if config.schedule == "time_linear":
            return [time_linear_commit_count(left, step_in_block, steps_per_block, config.schedule_eps)
                    for left in masked_left]
        if step_in_block >= steps_per_block:  # parallel decoding past the schedule's steps
            return [0] * len(masked_left)
        return [min(block_schedule[step_in_block], left) for left in masked_left]

    def rule_scores(self, logits: torch.Tensor, candidates: torch.Tensor,
                    generator: torch.Generator | None) -> torch.Tensor:
        """The remasking rule's scores [B, Lb] of a block from its logits [B, Lb, V] and candidates [B, Lb]
        (`rule_logits`)."""
        return _checked_scores(self.remasking_rule(self.rule_logits(logits), candidates, generator), candidates)

    def rule_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the remasking rule reads: logits / τ (τ > 0) for a rule marked `scores_sampling_distribution`,
        the logits themselves otherwise."""
        if getattr(self.remasking_rule, "scores_sampling_distribution", False) and self.config.temperature > 0:
            return logits / self.config.temperature
        return logits

    @property
    def commit_choice_depends_on_model(self) -> bool:
        """Whether the probability of a step's commit choice depends on the model: False for the ``random`` and
        ``origin`` rules (scores drawn from the generator, whatever the logits), whose choice has the same probability
        under every model and so cancels from the ratio."""
        return self.remasking_rule is not random_scores

    @property
    def reads_candidates(self) -> bool:
        """Whether the rule's scores depend on the candidates (not marked `ignores_candidates`): the candidates drawn
        at positions left masked then shape the commit choice."""
        return self.commit_choice_depends_on_model and not getattr(self.remasking_rule, "ignores_candidates", False)

    @property
    def records_discarded_candidates(self) -> bool:
        """Whether the complete ratio holds the candidates drawn and left uncommitted (their log-probs, and the
        record `discarded_candidates`): for a rule that reads them, unless threshold decoding sums over them
        (`threshold_stay_logprobs`, for a rule marked `scores_candidate_probability`)."""
        marginalised = (self.config.threshold is not None
                        and getattr(self.remasking_rule, "scores_candidate_probability", False))
        return self.reads_candidates and not marginalised

    def forced_commit_scores(self, logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """[B, Lb] the scores threshold decoding draws its forced commit from (`threshold_commits`): the rule's
        `scores` when it reads no candidate, else its scores of each position's most probable token, so that the
        forced choice reads no drawn candidate either."""
        if not self.reads_candidates:
            return scores
        return self.rule_scores(logits, logits.argmax(dim=-1), None)

    def threshold_stay_logprobs(self, logits: torch.Tensor, commit_logits: torch.Tensor) -> torch.Tensor:
        """[B, Lb] log P(position i stays masked) at a threshold step, `commit_logits` = (c − τ_c) / T at the drawn
        candidates: log(1 − σ(commit_logits)) (the candidate recorded, or read by no rule); for a rule marked
        `scores_candidate_probability`, summed over the candidate instead,
        log Σ_v q_i(v) (1 − σ((s_i(v) − τ_c) / T)), with q_i = softmax(logits / τ) what the candidate is drawn from
        (a point mass on the argmax at τ = 0) and s_i(v) = softmax(rule logits)[v] every token's score."""
        if self.records_discarded_candidates or not self.reads_candidates:
            return F.logsigmoid(-commit_logits.double())
        config = self.config
        token_scores = F.softmax(self.rule_logits(logits), dim=-1).float()
        stays = F.logsigmoid(-(token_scores - config.threshold) / config.position_temperature)
        if config.temperature > 0:
            draws = F.log_softmax(logits.float() / config.temperature, dim=-1)
        else:
            draws = torch.full_like(stays, -math.inf).scatter(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
        return torch.logsumexp(stays + draws, dim=-1)

    def step_choice_logprobs(self, logits: torch.Tensor, scores: torch.Tensor | None, still_masked: torch.Tensor,
                             commit: torch.Tensor, commit_rank: torch.Tensor | None,
                             candidate_logprobs: torch.Tensor) -> torch.Tensor:
        """float32 [B, Lb]: the log-probability of one step's outcome beyond its committed tokens', split over the
        block's positions, from the block's `logits` and the rule's `scores` of the candidates: the commit choice
        (`ranked_choice_logprobs` for a fixed count, or `committed_set_logprobs` with `commit_choice_as_set`;
        `threshold_choice_logprobs` for threshold decoding; 0 for a
        rule whose choice does not depend on the model) plus, when the ratio holds them
        (`records_discarded_candidates`), the log-prob `candidate_logprobs` of the candidate drawn at each
        still-masked position left uncommitted. With the committed tokens' log-probs (`step_logprobs`) this is the
        probability of the step's outcome; docs/algorithms.md, "The complete ratio"."""
        config = self.config
        terms = torch.zeros_like(candidate_logprobs, dtype=torch.float32)
        if self.commit_choice_depends_on_model and config.threshold is None and config.commit_choice_as_set:
            terms = committed_set_logprobs(scores, still_masked, commit, config.position_temperature,
                                           config.max_commits_per_step)
        elif self.commit_choice_depends_on_model and config.threshold is None:
            terms = ranked_choice_logprobs(scores, still_masked, commit, commit_rank, config.position_temperature)
        elif self.commit_choice_depends_on_model:
            commit_logits = (scores.double() - config.threshold) / config.position_temperature
            terms = threshold_choice_logprobs(commit_logits, self.threshold_stay_logprobs(logits, commit_logits),
                                              self.forced_commit_scores(logits, scores), still_masked, commit,
                                              config.position_temperature)
        if self.records_discarded_candidates:
            terms = terms + torch.where(still_masked & ~commit, candidate_logprobs.float(), 0.0)
        return terms

    @torch.no_grad()
    def choice_logprobs(self, model: Any, rollout: Rollout) -> torch.Tensor:
        """float32 [B, L]: `model`'s log-probability of `rollout`'s recorded commit choices (and discarded
        candidates, when recorded) (`Rollout.choice_logprobs`, `commit_rank`, `discarded_candidates`), per position
        as the sampler records it: each step replayed by `decoder_logits` (this sampler's cache, as sampled) and
        scored by `commit_choice_replay`. On the model that sampled, this is the recorded `choice_logprobs`; with
        the trajectory estimator's token log-probs it completes the ratio of the two samplers."""
        replay = self.commit_choice_replay(rollout)
        result = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
        for window, committed, logits in self.decoder_logits(model, rollout):
            result = result + replay(window, committed, logits)
        return result

    def commit_choice_replay(self, rollout: Rollout) -> "CommitChoiceReplay":
        """The scorer of `rollout`'s recorded commit choices, step by step along `decoder_logits`
        (`CommitChoiceReplay`)."""
        return CommitChoiceReplay(self, rollout)

    def decoder_logits(self, model: Any, rollout: Rollout, positions: torch.Tensor | None = None
                       ) -> Iterator[tuple[slice | torch.LongTensor, torch.Tensor, torch.Tensor]]:
        """The logits each completion token of `rollout` was drawn from, recomputed as this sampler computed them
        while sampling: step by step along `rollout.commit_step`, by `block_logits` with this sampler's block cache
        rebuilt at the steps where sampling rebuilt it (`DiffusionSamplerConfig.refreshes_cache`), so a cached
        step attends to the keys/values of the canvas at its block's last refresh. Under grad when grad is enabled.

        Yields, for each step that commits a token or refreshes the cache, ``(block, committed, logits)``: `block`
        the completion positions of the current block (a slice; for a block-causal model whose rows' completions
        start at different offsets in their blocks, [B, Lb] indices with −1 where a row's block position is no
        completion position: `CanvasLayout.completion_window`, read with `completion_window`), `committed` [B, Lb]
        the block positions committed at that step, `logits` [B, Lb, V] of the block. The steps of a block come in
        order, and a block's steps share its cache (a caller that backpropagates block by block keeps one block's
        graph at a time). Lazy: a forward runs when its step is asked for.

        A row's steps are counted from its block's first step (every row commits at least one token then), so
        rollouts sampled in separate calls, whose global step indices differ, replay together. Without a cache this
        is the trajectory replay, one full forward per step. With `positions` [B, L] bool, a block holding none of
        them is skipped (no forward): a block's replay needs its own steps and cache only.

        A block-causal model's exact cache of finished blocks is written along as sampling wrote it, forward for
        forward; under grad it is rebuilt at each block's first step instead (a forward of the canvas up to the
        block: the same logits to rounding), so that each block's graph holds its own cache and a caller that
        backpropagates block by block never reaches into a freed one.

        The replay keeps its cache in the model's dtype whatever `cache_dtype` says: FP8 storage is an approximation
        of the rollout engine, which the importance ratio (the sampler's recorded log-probs against this replay)
        sees like the engine's weight precision; the trainer's ℓ_old and ℓ_θ are the same replay.
        """
        token_ids = self.resolve_token_ids(model)
        if rollout.gen_length != self.config.gen_length:
            raise ValueError(f"decoder_logits got completions of {rollout.gen_length} positions; this sampler decodes "
                             f"gen_length={self.config.gen_length}")
        prompt_attention = padding_or_none(rollout.attention_mask[:, :rollout.prompt_length])
        layout = self.canvas_layout(rollout.prompt_ids, prompt_attention, token_ids)
        final_canvas = layout.canvas.scatter(1, layout.completion_index, rollout.completion_ids)
        commit_step = layout.on_canvas(rollout.commit_step, -1)  # -1 off the completion
        in_completion = layout.on_canvas(torch.ones_like(rollout.commit_step, dtype=torch.bool), False)
        not_in_block = commit_step.max() + 1  # a row with no completion position in a block: steps from here
        cache = self.block_cache(token_ids, sampling=False)
        for block in layout.blocks:
            window = layout.completion_window(block)
            if positions is not None and not bool((completion_window(positions, window)
                                                   & in_completion[:, block]).any()):
                continue
            if cache is not None and token_ids.block_causal and torch.is_grad_enabled():
                cache = self.block_cache(token_ids, sampling=False)  # rebuilt by this block: its own graph
            block_steps = commit_step[:, block]
            first = torch.where(block_steps >= 0, block_steps, not_in_block).amin(dim=1, keepdim=True)
            step_in_block = commit_step - first  # [B, T]: < 0 before the block and off the completion
            for step in range(int(step_in_block[:, block].max()) + 1):
                committed = step_in_block[:, block] == step
                refresh = cache is not None and self.config.refreshes_cache(step)
                if not (refresh or bool(committed.any())):
                    continue
                if cache is not None:
                    cache.refresh = refresh
                canvas = torch.where((step_in_block >= step) & in_completion, token_ids.mask, final_canvas)
                yield window, committed, self.block_logits(model, canvas, layout.attention, layout.prompt_length,
                                                           block, token_ids, cache)

    def block_logits(
        self,
        model: Any,
        canvas: torch.LongTensor,
        attention_mask: torch.Tensor | None,
        prompt_length: int,
        block: slice | torch.Tensor,
        token_ids: SpecialTokenIds,
        cache: BlockCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, K, V] at the positions `block` of `canvas` [B, T]: while sampling, the current block (a slice;
        one forward over the whole canvas, or with a `cache` (``config.cache`` = prefix | dual) its
        `BlockCache.block_forward`); while scoring (`scoring_logits`), a 1-D tensor of canvas positions, no cache.

        With cfg_scale s > 0 the canvas and a copy with every prompt position (padding included) set to the mask id
        run as one [2B] forward (the cache then holds both halves), and ``logits = u + (s + 1)(c − u)``. For a
        shifted family (``token_ids.logits_shifted``) the logits predicting position i are the forward's at i − 1.

        An override (another guidance, a logit bias, ...) must handle both kinds of `block` (``logits[:, block]``
        and ``canvas[:, block]`` do) and is scored exactly as it samples: the likelihood estimators call it through
        `scoring_logits`.
        """
        scale = self.config.cfg_scale
        inputs, inputs_attention = canvas, attention_mask
        if scale > 0:
            prompt_masked = canvas.clone()
            prompt_masked[:, :prompt_length] = token_ids.mask
            inputs = torch.cat([canvas, prompt_masked])
            inputs_attention = None if attention_mask is None else attention_mask.repeat(2, 1)
        if cache is None:
            logits = _forward_logits(model, inputs, inputs_attention, block, token_ids.logits_shifted)
        else:
            logits = cache.block_forward(model, inputs, inputs_attention, block, token_ids.logits_shifted)
        if scale > 0:
            conditional, unconditional = logits.chunk(2)
            logits = unconditional + (scale + 1) * (conditional - unconditional)
        return logits

    def scoring_logits(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        logits_to_keep: torch.Tensor | int,
    ) -> torch.Tensor:
        """The likelihood estimators' ``logits_fn`` (`dllm_ais.likelihood.LogitsFn`): logits [B, K, V] at the kept
        positions of canvases `input_ids` [B, P + gen_length], computed by `block_logits` as sampling computes them
        (guidance and any subclass's logit processing included), without a cache: the trainer side scores the exact
        policy, and a cache's approximation stays visible in the ratio.

        `logits_to_keep` is the number of last positions (the one-step surrogate: the whole completion) or a 1-D
        tensor of canvas positions (the trajectory replay: the positions committed at the replayed steps). The prompt
        (what guidance masks for its unconditional half) is everything before the last ``config.gen_length``
        positions.
        """
        total_length = input_ids.shape[1]
        prompt_length = total_length - self.config.gen_length
        if prompt_length < 1:
            raise ValueError(
                f"scoring_logits got canvases of {total_length} positions, but this sampler completes "
                f"gen_length={self.config.gen_length} positions after a prompt: score rollouts of this sampler."
            )
        positions = logits_to_keep
        if not isinstance(positions, torch.Tensor):
            first = total_length - positions if positions else 0
            positions = torch.arange(first, total_length, device=input_ids.device)
        return self.block_logits(model, input_ids, attention_mask, prompt_length, positions,
                                 self.resolve_token_ids(model))

    def with_config(self, config: DiffusionSamplerConfig) -> "MaskedDiffusionSampler":
        """This sampler (its class and stages) with other settings, e.g. greedy for evaluation or without cache and
        parallel decoding for an exact-order replay: a shallow copy holding `config`. A subclass whose ``__init__``
        derives state from its config overrides this."""
        copied = copy.copy(self)
        copied.config = config
        copied.remasking_rule = resolve_remasking_rule(config.remasking)
        return copied

    def propose_tokens(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.LongTensor, torch.Tensor]:
        """Candidate x̂ [B, M] drawn from softmax(logits / τ) (argmax at τ = 0) and its float32 log-prob [B, M].

        `logits` [B, M, V] are those of the block's still-masked positions (rows with fewer than M masked positions
        are completed with committed ones, whose candidates are ignored).
        """
        candidates = gumbel_argmax(logits, self.config.temperature, generator)
        return candidates, self.token_logprobs(logits, candidates)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
        """float32 log-prob [B, M] of `tokens` under the distribution `propose_tokens` draws from: softmax(logits / τ)
        (a subclass that changes the draw, e.g. to top-p, changes this with it; `replay` scores with it)."""
        return sampling_logprobs(logits, tokens, self.config.temperature)

    def choose_positions(self, row_scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """[B, T] bool: per row b, the `counts[b]` top-scored positions of the full canvas row.

        `row_scores` [B, T] is −∞ everywhere but the current block's masked positions. Selection is
        ``torch.topk(row_scores[b], counts[b])`` over the full row, as in the official implementation, so ties are
        broken identically; rows sharing a count go through one batched topk (each row is an independent slice).
        With parallel decoding, `counts` come from `parallel_commit_counts`, so the top-`counts[b]` positions are
        those above the threshold (or the factor rule's n).
        An override must choose at least `counts[b]` positions per row (while that many are masked): the schedule
        fills each block in its steps on that assumption.
        """
        chosen = torch.zeros_like(row_scores, dtype=torch.bool)
        distinct_counts = set(counts)
        for count in distinct_counts - {0}:
            if len(distinct_counts) == 1:
                chosen.scatter_(1, row_scores.topk(count, dim=1).indices, True)
            else:
                rows = torch.tensor([b for b, c in enumerate(counts) if c == count], device=row_scores.device)
                top = row_scores.index_select(0, rows).topk(count, dim=1).indices
                chosen[rows] = chosen[rows].scatter(1, top, True)
        return chosen
