"""Remasking rules: which still-masked positions of a block a denoising step commits first.

A rule is a callable ``rule(block_logits [B, Lb, V], candidates [B, Lb], generator) -> scores [B, Lb]``; higher
scores commit first. LLaDA's, Dream's and the autoregressive order are registered by name (`REMASKING_RULES`); a
rule of one's own is passed as the callable or registered with `register_remasking_rule`. The markers below tell the
sampler what a rule reads (the tempered logits, the candidates, only the candidate's probability).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["REMASKING_RULES", "RemaskingRule", "checked_scores", "depends_on_model", "ignores_candidates",
           "left_to_right_scores", "low_confidence_scores", "negative_entropy_scores", "random_scores",
           "reads_candidates", "register_remasking_rule", "resolve_remasking_rule", "sampled_token_probability_scores",
           "scores_candidate_probability", "scores_sampling_distribution", "top_log_odds_scores",
           "top_probability_scores", "top_two_margin_scores"]

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


def checked_scores(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The remasking rule's scores as a floating tensor (−∞ marks unavailable positions), after a shape check."""
    if scores.shape != candidates.shape:
        raise ValueError(
            f"The remasking rule returned scores of shape {tuple(scores.shape)}; it must return one score per block "
            f"position, shape {tuple(candidates.shape)} like its `candidates` argument."
        )
    return scores if scores.is_floating_point() else scores.float()


def depends_on_model(rule: RemaskingRule) -> bool:
    """Whether the probability of a step's commit choice under `rule` depends on the model: False for the ``random``
    and ``origin`` rules (scores drawn from the generator, whatever the logits), whose choice has the same probability
    under every model and so cancels from the ratio."""
    return rule is not random_scores


def reads_candidates(rule: RemaskingRule) -> bool:
    """Whether `rule`'s scores depend on the candidates (a rule not marked `ignores_candidates`): the candidates drawn
    at positions left masked then shape the commit choice."""
    return depends_on_model(rule) and not getattr(rule, "ignores_candidates", False)
