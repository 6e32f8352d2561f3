"""What differs between the masked-diffusion model families, for the sampler and the likelihood estimators.

=========  ================  =============================================  ==============================
family     model_type        mask token id                                  logits predicting position i
=========  ================  =============================================  ==============================
LLaDA      ``llada``         config.json ``mask_token_id`` (126336)         position i
Dream      ``Dream``         config.json ``mask_token_id`` (151666)         position i - 1 (shifted)
=========  ================  =============================================  ==============================

Dream (and DiffuCoder, same architecture) was initialised from an autoregressive Qwen2.5 and keeps its next-token
head: the logits at position i - 1 predict the token at i. `shift_logits_right` turns such logits into per-position
ones, as the official generation code does before sampling.
"""

from __future__ import annotations

import torch

SHIFTED_LOGITS_MODEL_TYPES = frozenset({"Dream"})
"""model_types whose logits at position i - 1 predict the token at position i."""


def logits_are_shifted(model_type: str | None) -> bool:
    """Whether a diffusion model of `model_type` predicts position i from the logits at i - 1 (see the table above)."""
    return model_type in SHIFTED_LOGITS_MODEL_TYPES


def shift_logits_right(logits: torch.Tensor) -> torch.Tensor:
    """Per-position logits [B, L, V] from a shifted family's logits [B, L, V]: position i gets the logits computed at
    i - 1; position 0, which has no predecessor, keeps its own (official Dream: ``cat([logits[:, :1],
    logits[:, :-1]], 1)``)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
