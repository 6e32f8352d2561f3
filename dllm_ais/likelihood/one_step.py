"""The diffu-GRPO one-step surrogate, the default masked-diffusion estimator: every completion token scored at the
fully masked completion (the prompt partly masked, d1's way), one forward."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    LogitsFn,
    _check_canvas,
    _check_mask_token,
    mask_generator,
    noisy_canvas_logits,
    plain_logits,
    selective_log_softmax,
)


def one_step_masked_input(
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    seed: int,
    p_mask_prompt: float = 0.15,
) -> Tensor:
    """The diffu-GRPO input canvas: every completion token → mask; each real prompt token → mask w.p. p.

    The prompt mask is `torch.rand((B, P), generator=mask_generator(seed)) < p_mask_prompt`, drawn on
    the CPU and then moved, restricted to real tokens (attention_mask == 1): padding stays as it is.
    Returns a new [B, P + L] long tensor; `sequences` is not modified.
    """
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    if not 0 <= p_mask_prompt <= 1:
        raise ValueError(f"p_mask_prompt must be a probability in [0, 1] (d1 default 0.15); got {p_mask_prompt}")
    batch = sequences.shape[0]
    draws = torch.rand((batch, prompt_length), generator=mask_generator(seed)).to(sequences.device)
    masked_prompt = (draws < p_mask_prompt) & attention_mask[:, :prompt_length].bool()
    prompt = sequences[:, :prompt_length].masked_fill(masked_prompt, mask_token_id)
    completion = torch.full_like(sequences[:, prompt_length:], mask_token_id)
    return torch.cat([prompt, completion], dim=1)


def one_step_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    mask_token_id: int,
    seed: int,
    p_mask_prompt: float = 0.15,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
    logits_fn: LogitsFn = plain_logits,
) -> Tensor | tuple[Tensor, Tensor]:
    """diffu-GRPO one-step surrogate: ℓ(o^k) = log softmax(f(x̃)_{P+k})[o^k], one forward for all k.

    x̃ = `one_step_masked_input(...)` (all completion tokens masked, each real prompt token masked with
    probability p_mask_prompt, drawn from a generator seeded with `seed`); plain softmax, no temperature
    (as d1). A block-causal family (SDAR) scores each block fully masked against the clean completion blocks before
    it and the masked prompt (`noisy_canvas_logits`): the one-step surrogate per block. Reuse the same `seed` for
    ℓ_rollout, ℓ_old, ℓ_ref and ℓ_θ of one inner iteration.
    Returns [B, L] float32 for every completion position (apply the completion mask downstream); with
    `compute_entropy`, also the entropy [B, L] of the distribution scored at each position (from the same logits).
    """
    _check_mask_token(model, mask_token_id)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    noisy = one_step_masked_input(sequences, attention_mask, prompt_length, mask_token_id, seed, p_mask_prompt)
    gen_length = sequences.shape[1] - prompt_length
    logits = noisy_canvas_logits(model, noisy, sequences[:, prompt_length:], attention_mask, gen_length, logits_fn)
    return selective_log_softmax(logits, sequences[:, prompt_length:], chunk_size, compute_entropy=compute_entropy)
