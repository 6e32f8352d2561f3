"""What differs between the masked-diffusion model families, for the sampler, the likelihood estimators and SFT.

=========  ================  =============================================  ==============================
family     model_type        mask token id                                  logits predicting position i
=========  ================  =============================================  ==============================
LLaDA      ``llada``         config.json ``mask_token_id`` (126336)         position i
Dream      ``Dream``         config.json ``mask_token_id`` (151666)         position i - 1 (shifted)
SDAR       ``sdar``          config.json ``mask_token_id`` (151669)         position i
LLaDA2.x   ``llada2_moe``    config ``mask_token_id`` (156895)              position i
=========  ================  =============================================  ==============================

Dream (and DiffuCoder, same architecture) was initialised from an autoregressive Qwen2.5 and keeps its next-token
head: the logits at position i - 1 predict the token at i; position 0, which has no predecessor, keeps its own (the
official generation code: ``cat([logits[:, :1], logits[:, :-1]], 1)``). Every place that turns a forward into
per-position logits goes through `position_logits` (or, where it already holds a forward's logits, the same index
map `logit_source_positions`), so the shift is written once.

SDAR (block diffusion: attention causal across blocks of ``block_size`` positions counted from the first real
token, bidirectional inside one) is in `BLOCK_CAUSAL_MODEL_TYPES`: the sampler decodes it block by block along each
row's own blocks, against the exact cache of the finished blocks (`dllm_ais.sampling.diffusion`, "Block-causal
models"), and every likelihood estimator scores each of its blocks against the clean blocks before it (its
training-mode forward, `dllm_ais.models.sdar.block_diffusion_logits`). A position sees the later positions of its own
block, so a block-causal model is never scored as a causal LM (`policy.is_diffusion` refuses
``policy: autoregressive`` for it). LLaDA2.x (the mixture-of-experts block-diffusion family, `dllm_ais.models.llada2`)
has the same mask over its own ``block_size`` (32 unless its config.json says otherwise) and the same
[x_t | x_0] training-mode forward (a 4-D mask passed to its ordinary forward).

A third family is its model module under ``dllm_ais/models/`` plus one row here: its model_type in
`DIFFUSION_MODEL_TYPES`, and in `SHIFTED_LOGITS_MODEL_TYPES` when it reads position i from i - 1.
"""

from __future__ import annotations

from typing import Any

import torch

DIFFUSION_MODEL_TYPES = frozenset({"llada", "Dream", "sdar", "llada2_moe"})
"""model_types that are masked-diffusion models (``policy: auto`` trains them with the diffusion policy)."""

SHIFTED_LOGITS_MODEL_TYPES = frozenset({"Dream"})
"""model_types whose logits at position i - 1 predict the token at position i."""

BLOCK_CAUSAL_MODEL_TYPES = frozenset({"sdar", "llada2_moe"})
"""model_types whose attention is causal across blocks of ``config.block_size`` positions counted from each row's
first real token and bidirectional inside one (block diffusion)."""

__all__ = ["BLOCK_CAUSAL_MODEL_TYPES", "DIFFUSION_MODEL_TYPES", "SHIFTED_LOGITS_MODEL_TYPES",
           "is_block_causal", "logit_source_positions", "logits_are_shifted", "model_type_of", "position_logits",
           "shift_logits_right"]


def model_type_of(model: Any) -> str | None:
    """``model.config.model_type`` of a model, or of the model a wrapper (DDP, FSDP, torch.compile) holds; None when
    there is none."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        model_type = getattr(getattr(candidate, "config", None), "model_type", None)
        if model_type is not None:
            return model_type
    return None


def _model_type(model_or_type: Any) -> str | None:
    return model_or_type if isinstance(model_or_type, str) or model_or_type is None else model_type_of(model_or_type)


def logits_are_shifted(model_or_type: Any) -> bool:
    """Whether a diffusion model (or a model_type string) predicts position i from the logits at i - 1."""
    return _model_type(model_or_type) in SHIFTED_LOGITS_MODEL_TYPES


def is_block_causal(model_or_type: Any) -> bool:
    """Whether a diffusion model (or a model_type string) attends causally across blocks (`BLOCK_CAUSAL_MODEL_TYPES`)."""
    return _model_type(model_or_type) in BLOCK_CAUSAL_MODEL_TYPES


def shift_logits_right(logits: torch.Tensor) -> torch.Tensor:
    """Per-position logits [B, L, V] from a shifted family's logits [B, L, V]: position i gets the logits computed at
    i - 1; position 0 keeps its own."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def logit_source_positions(positions: torch.Tensor, shifted: bool) -> torch.Tensor:
    """The forward positions whose logits predict `positions` (any integer tensor): max(p − 1, 0) for a shifted
    family, p itself otherwise."""
    return (positions - 1).clamp_min(0) if shifted else positions


def position_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    logits_to_keep: torch.Tensor | int = 0, shifted: bool | None = None, **forward_kwargs
                    ) -> torch.Tensor:
    """Logits [B, K, V] predicting the kept positions of `input_ids` [B, T]: all of them (`logits_to_keep` = 0), the
    last `logits_to_keep` (an int), or the canvas positions of a 1-D tensor, whatever the family.

    An unshifted family is asked for those positions (``model(..., logits_to_keep=...)``); a shifted one for
    `logit_source_positions` of them, so its LM head too runs at K positions only. All positions are one plain
    forward (``shift_logits_right`` of it for a shifted family). `shifted` None = from the model's
    model_type. Extra keyword arguments go to the forward.
    """
    shifted = logits_are_shifted(model) if shifted is None else shifted
    keep_all = not isinstance(logits_to_keep, torch.Tensor) and not logits_to_keep
    if keep_all:  # one full forward, whatever the model's forward makes of logits_to_keep
        output = model(input_ids, attention_mask=attention_mask, **forward_kwargs)
    else:
        if shifted:
            length = input_ids.shape[1]
            if not isinstance(logits_to_keep, torch.Tensor):
                logits_to_keep = torch.arange(length - logits_to_keep, length, device=input_ids.device)
            logits_to_keep = logit_source_positions(logits_to_keep, True)
        output = model(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, **forward_kwargs)
    logits = output.logits if hasattr(output, "logits") else output
    return shift_logits_right(logits) if keep_all and shifted else logits
