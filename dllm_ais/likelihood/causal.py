"""The causal-LM estimator: teacher-forced completion log-probs under the sampling distribution the
autoregressive sampler used, and the checks and position ids it shares with that sampler."""
from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from dllm_ais.likelihood.logits import (
    DEFAULT_CHUNK_ROWS,
    _check_canvas,
    check_sampling_parameters,
    selective_log_softmax,
    shape_logits,
)
from dllm_ais.models.families import is_diffusion_family


def causal_position_ids(attention_mask: Tensor) -> Tensor:
    """position_ids = cumsum(attention_mask) − 1, clamped at 0: left padding does not shift positions."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def require_causal_lm(model: nn.Module, caller: str) -> None:
    """Raise ValueError if `model` is a masked-diffusion (LLaDA, Dream) or encoder-decoder model."""
    config = getattr(model, "config", None)
    if is_diffusion_family(getattr(config, "model_type", None)):
        raise ValueError(
            f"{caller} needs a causal LM, but this is a {config.model_type} masked-diffusion model (bidirectional). "
            "Use MaskedDiffusionSampler with one_step_logprobs / trajectory_logprobs instead."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{caller} supports decoder-only causal LMs; got an encoder-decoder model ({config.model_type})."
        )


def causal_logprobs(
    model: nn.Module,
    sequences: Tensor,
    attention_mask: Tensor | None,
    prompt_length: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    compute_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced completion log-probs under a causal LM's sampling distribution: [B, L] float32.

    ℓ(o^k) = log softmax(shape_logits(f(x)_{P+k−1}, τ, top_k, top_p))[o^k]: one forward with
    `logits_to_keep = L + 1`, shifted by one, position_ids = cumsum(attention_mask) − 1 (clamped at 0).
    The trainer-side twin of `AutoregressiveSampler`'s `step_logprobs` (same processing, same numbers
    up to kernel rounding). Tokens the top-k/top-p filters remove get −inf. With `compute_entropy`, also the
    per-token entropy [B, L] of that sampling distribution, from the same logits.
    """
    require_causal_lm(model, "causal_logprobs")
    check_sampling_parameters(temperature, top_k, top_p)
    attention_mask = _check_canvas(sequences, attention_mask, prompt_length)
    gen_length = sequences.shape[1] - prompt_length
    logits = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=causal_position_ids(attention_mask),
        use_cache=False,
        logits_to_keep=gen_length + 1,
    ).logits[:, :-1]
    process = partial(shape_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return selective_log_softmax(logits, sequences[:, prompt_length:], chunk_size, process_logits=process,
                                 compute_entropy=compute_entropy)
