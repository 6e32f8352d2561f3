"""Sequence-level Monte-Carlo bounds on log p(completion | prompt): LLaDA's ELBO (optionally with coupled,
complementary masks) and SPG's EUBO and its sandwich with the ELBO by the sign of the advantage, over LLaDA's or
SPG's block-wise masks; `BoundSettings`, their settings.

They estimate one number per completion; `registry.DiffusionEstimator` says how it meets the token-level stages
(`spread_over_tokens`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    LogitsFn,
    _check_canvas,
    _check_mask_token,
    _scatter_to_positions,
    is_plain_int,
    mask_generator,
    noisy_canvas_logits,
    plain_logits,
    selective_log_softmax,
)


@dataclass(frozen=True)
class MaskDraw:
    """One draw of the forward (masking) process over the completion: `masked` [B, L] bool, the completion
    positions replaced by the mask token, and `rate` [B] float32, the mask rate t whose 1/t weighs the draw."""

    masked: Tensor
    rate: Tensor


def random_mask_draws(batch: int, gen_length: int, num_samples: int, generator: torch.Generator,
                      coupled: bool = False) -> list[MaskDraw]:
    """LLaDA's forward process, `num_samples` times: t = 1 − rand(B) ∈ (0, 1], then u = rand(B, L) and position k
    masked iff u_k < t, the position with the smallest u always (so at least one is).

    `coupled` (coupled-GRPO's complementary masks): each draw is followed by its complement, the positions it left
    clean, at rate 1 − t — every position is masked exactly once per pair, and the complement of a draw at rate t is
    itself (up to the forced position) a draw at rate 1 − t ~ U[0, 1): 2 · num_samples draws, antithetic in t.
    """
    draws = []
    for _ in range(num_samples):
        rate = 1.0 - torch.rand(batch, generator=generator)
        uniform = torch.rand((batch, gen_length), generator=generator)
        masked = (uniform < rate.unsqueeze(1)) | (uniform == uniform.min(dim=1, keepdim=True).values)
        draws.append(MaskDraw(masked, rate))
        if coupled:
            draws.append(MaskDraw(~masked, 1.0 - rate))
    return draws


def block_mask_draws(completion_mask: Tensor, block_length: int, num_samples: int,
                     generator: torch.Generator) -> list[MaskDraw]:
    """SPG's block-wise masking, `num_samples` times, on [B, L] completions split into blocks of `block_length`.

    Per draw and sequence: a block b uniformly among the blocks holding a valid token (`completion_mask`); the blocks
    before b stay clean, the blocks after b are masked whole; in b, k ~ U{1, …, v_b} of its v_b valid positions are
    masked (chosen uniformly) and so is its padding. The rate is SPG's empirical one, t̂ = (masked valid positions) /
    (valid positions), 1 for a sequence without valid tokens. Draws come from `generator`: rand(B) for b, rand(B)
    for k, rand(B, L) for the positions.
    """
    if not is_plain_int(block_length) or block_length < 1 or completion_mask.shape[1] % block_length:
        raise ValueError(f"block_length must be a positive int dividing the completion length "
                         f"{completion_mask.shape[1]} (the sampler's block_length); got {block_length!r}")
    valid = completion_mask.bool().cpu()
    batch, gen_length = valid.shape
    position_block = torch.arange(gen_length) // block_length  # [L]
    block_has_valid = valid.view(batch, -1, block_length).any(dim=2)  # [B, blocks]
    block_rank = block_has_valid.long().cumsum(dim=1) - 1  # [B, blocks]: rank among the blocks with a valid token
    num_valid = valid.sum(dim=1)
    draws = []
    for _ in range(num_samples):
        pick = (torch.rand(batch, generator=generator) * block_has_valid.sum(dim=1)).long()
        chosen = (block_has_valid & (block_rank == pick.unsqueeze(1))).long().argmax(dim=1, keepdim=True)  # [B, 1]
        in_block = position_block.unsqueeze(0) == chosen
        candidates = in_block & valid
        count = 1 + (torch.rand(batch, generator=generator) * candidates.sum(dim=1)).long()  # k ∈ {1, …, v_b}
        order = torch.rand((batch, gen_length), generator=generator).masked_fill(~candidates, 2.0)
        rank = order.argsort(dim=1).argsort(dim=1)  # candidates first, in random order
        masked = (position_block.unsqueeze(0) > chosen) | (in_block & ~valid) | (candidates & (rank < count[:, None]))
        rate = torch.where(num_valid > 0, (masked & valid).sum(dim=1) / num_valid.clamp(min=1), 1.0)
        draws.append(MaskDraw(masked, rate.float()))
    return draws


def _prompt_masks(attention_mask: Tensor, prompt_length: int, num_draws: int, p_mask_prompt: float,
                  generator: torch.Generator) -> list[Tensor | None]:
    """Per draw, the real prompt tokens to mask, each with probability p (d1's prompt masking): one
    rand(num_draws, B, P) after the completion draws; None each when p = 0 (nothing drawn)."""
    if not 0 <= p_mask_prompt <= 1:
        raise ValueError(f"p_mask_prompt must be a probability in [0, 1]; got {p_mask_prompt}")
    if p_mask_prompt == 0:
        return [None] * num_draws
    real = attention_mask[:, :prompt_length].bool().cpu()
    draws = torch.rand((num_draws, *real.shape), generator=generator)
    return list((draws < p_mask_prompt) & real)


def masked_completion_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    mask_token_id: int,
    masked: Tensor,
    prompt_masked: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """ℓ_k = log softmax(f(x̃)_{P+k})[o^k] at the completion positions `masked` [B, L] puts under the mask token,
    0 elsewhere: [B, L] float32, one forward; x̃ = `sequences` with those positions (and the prompt positions
    `prompt_masked` [B, P], if given) replaced by the mask id; for a block-causal family (SDAR) each block against
    the clean completion blocks before it (`noisy_canvas_logits`: with the 1/t weight of `elbo_from_draws`, SDAR's
    own training loss). With `compute_entropy`, also the entropy there."""
    device = sequences.device
    completion = sequences[:, prompt_length:]
    prompt = sequences[:, :prompt_length]
    if prompt_masked is not None:
        prompt = prompt.masked_fill(prompt_masked.to(device), mask_token_id)
    masked = masked.to(device)
    noisy = torch.cat([prompt, completion.masked_fill(masked, mask_token_id)], dim=1)
    logits = noisy_canvas_logits(model, noisy, completion, attention_mask, completion.shape[1], logits_fn)
    scored = selective_log_softmax(logits[masked], completion[masked], chunk_size, compute_entropy=compute_entropy)
    if compute_entropy:
        return _scatter_to_positions(masked, scored[0]), _scatter_to_positions(masked, scored[1])
    return _scatter_to_positions(masked, scored)


def _scored_draws(model: nn.Module, sequences: Tensor, attention_mask: Tensor, prompt_length: int, mask_token_id: int,
                  draws: list[MaskDraw], generator: torch.Generator, p_mask_prompt: float, chunk_size: int,
                  compute_entropy: bool, logits_fn: LogitsFn) -> list:
    """`masked_completion_logprobs` of each draw (one forward each), the prompt masked as `_prompt_masks` draws it
    from `generator` after the completion draws."""
    prompt_masks = _prompt_masks(attention_mask, prompt_length, len(draws), p_mask_prompt, generator)
    return [masked_completion_logprobs(model, sequences, attention_mask, prompt_length, mask_token_id, draw.masked,
                                       prompt_masked, chunk_size, compute_entropy, logits_fn)
            for draw, prompt_masked in zip(draws, prompt_masks)]


def elbo_from_draws(draw_logprobs: list[Tensor], draws: list[MaskDraw], scored: Tensor | None = None) -> Tensor:
    """The Monte-Carlo ELBO [B] of n draws: (1/n) Σ_d (1/t_d) Σ_k s_k m_{d,k} ℓ_{d,k}, with ℓ_{d,k} the log-prob
    of token k under draw d's canvas (`masked_completion_logprobs`), m_d its mask, t_d its rate and s the positions
    scored (`scored` [B, L], all when None). A draw with t_d = 0 (an empty complement) adds 0."""
    total = torch.zeros_like(draw_logprobs[0][:, 0])
    for logprobs, draw in zip(draw_logprobs, draws):
        kept = draw.masked.to(logprobs.device) if scored is None else draw.masked.to(logprobs.device) & scored.bool()
        rate = draw.rate.to(logprobs.device)
        per_draw = torch.where(kept, logprobs, 0.0).sum(dim=1)
        total = total + torch.where(rate > 0, per_draw / rate.clamp(min=1e-30), 0.0)
    return total / len(draws)


def eubo_from_draws(draw_logprobs: list[Tensor], draws: list[MaskDraw], beta: float,
                    scored: Tensor | None = None) -> Tensor:
    """SPG's evidence upper bound [B] (without its θ-independent constant) from n draws, β ≥ 1:

        E_k = (1/n) Σ_d m_{d,k} π_{d,k}^β / t_d,    EUBO = (N / |S|) · (1/β) Σ_{k ∈ S} log E_k,

    over the scored positions (`scored` [B, L], all when None; N of them) and S ⊆ them, those some draw masked
    (E_k > 0); log E_k = logsumexp_d(β ℓ_{d,k} − log t_d) − log n over the draws masking k. When every scored
    position is masked by some draw (a coupled pair; a single position) N / |S| = 1 and this is the paper's
    (1/β) Σ_k log E_k; otherwise the mean over S stands for the unseen positions, as SPG's code averages over S.
    0 for a sequence with S empty."""
    if not beta >= 1:
        raise ValueError(f"the EUBO needs beta >= 1 (SPG: 1.0 to 2.0); got {beta}")
    terms = []
    for logprobs, draw in zip(draw_logprobs, draws):
        masked = draw.masked.to(logprobs.device)
        log_rate = draw.rate.to(logprobs.device).clamp(min=1e-30).log().unsqueeze(1)
        terms.append(torch.where(masked, beta * logprobs - log_rate, -math.inf))
    log_e = torch.stack(terms).logsumexp(dim=0) - math.log(len(draws))  # [B, L], −inf where no draw masks k
    seen = torch.isfinite(log_e) if scored is None else torch.isfinite(log_e) & scored.bool()
    num_scored = torch.full_like(log_e[:, 0], log_e.shape[1]) if scored is None else scored.sum(dim=1).float()
    mean_seen = torch.where(seen, log_e, 0.0).sum(dim=1) / seen.sum(dim=1).clamp(min=1)
    return num_scored * mean_seen / beta


def sandwiched_log_likelihood(elbo: Tensor, eubo: Tensor, advantages: Tensor, mix_weight: float) -> Tensor:
    """SPG's per-sequence log-likelihood surrogate [B]: the ELBO where A ≥ 0 (raising a lower bound raises the
    likelihood), ω · EUBO + (1 − ω) · ELBO where A < 0 (lowering an upper bound lowers it; ω = `mix_weight`,
    ω = 1 the pure EUBO, 0 the ELBO alone)."""
    if not 0 <= mix_weight <= 1:
        raise ValueError(f"mix_weight must lie in [0, 1]; got {mix_weight}")
    if advantages.shape != elbo.shape:
        raise ValueError(f"advantages must be one per sequence, {tuple(elbo.shape)}; got {tuple(advantages.shape)}")
    negative = mix_weight * eubo + (1.0 - mix_weight) * elbo
    return torch.where(advantages.to(elbo.device) < 0, negative, elbo)


def spread_over_tokens(sequence_values: Tensor, completion_mask: Tensor) -> Tensor:
    """A sequence-level value v [B] as per-token values [B, L]: v / |o| at each of the |o| valid tokens, 0 elsewhere —
    their sum is v, and a token-level log-ratio of two such values is the sequence's length-normalised log-ratio."""
    valid = completion_mask.bool()
    length = valid.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(valid, sequence_values.unsqueeze(1) / length, 0.0)


def mc_elbo(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    num_samples: int,
    seed: int,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    logits_fn: LogitsFn = plain_logits,
    coupled: bool = False,
    completion_mask: Tensor | None = None,
    p_mask_prompt: float = 0.0,
) -> Tensor:
    """LLaDA's Monte-Carlo lower bound on log p(completion | prompt): [B] float32, ≤ 0.

    Per draw and sequence: t ~ U(0, 1], each completion token masked independently with probability t
    (the token with the smallest draw always, so at least one is), then
        ELBO = (1 / t) · Σ_{k masked} log softmax(f(x̃)_{P+k})[o^k],
    averaged over `num_samples` draws (one forward each): `random_mask_draws` then `elbo_from_draws`. `coupled`
    pairs each draw with its complement at rate 1 − t (coupled-GRPO; 2 · num_samples forwards, every token scored
    once per pair). Every completion position counts (LLaDA learns its EOS padding as a target) unless
    `completion_mask` [B, L] names the scored ones (padding is still masked at rate t, as context); the prompt is
    never masked unless `p_mask_prompt` > 0 (d1's prompt masking, drawn after the completion draws). Draws come
    from `mask_generator(seed)`: per draw, t = 1 − rand(B), then rand(B, L).
    """
    _check_mask_token(model, mask_token_id)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    if not is_plain_int(num_samples) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int (Monte-Carlo draws); got {num_samples!r}")
    generator = mask_generator(seed)
    batch, gen_length = sequences.shape[0], sequences.shape[1] - prompt_length
    draws = random_mask_draws(batch, gen_length, num_samples, generator, coupled)
    logprobs = _scored_draws(model, sequences, attention_mask, prompt_length, mask_token_id, draws, generator,
                             p_mask_prompt, chunk_size, False, logits_fn)
    return elbo_from_draws(logprobs, draws, completion_mask)


@dataclass(frozen=True)
class BoundSettings:
    """The Monte-Carlo bound estimators' settings (`elbo`, `spg`): `num_samples` draws of the masking process per
    estimate (config `elbo_samples`, SPG's num_t), `coupled` complementary pairs (`elbo_coupled`), SPG's block-wise
    masking over blocks of `block_length` (`spg_block_masking`; the sampler's block length), its EUBO exponent β
    (`spg_eubo_beta`) and the EUBO's weight ω in the negative-advantage mixture (`spg_mix_weight`)."""

    num_samples: int = 2
    coupled: bool = False
    block_masking: bool = False
    block_length: int | None = None
    eubo_beta: float = 1.5
    mix_weight: float = 0.5
