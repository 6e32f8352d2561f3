"""Drawing a step's candidate tokens: the Gumbel-max draw, its log-probabilities, Dream's top-p / top-k filter and
the Gumbel perturbation that turns a top-n choice of positions into a draw without replacement."""

from __future__ import annotations

import math

import torch

__all__ = ["filter_top_p_top_k", "gumbel_argmax", "masked_positions_first", "perturb_scores_for_sampling",
           "sampling_logprobs"]


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

