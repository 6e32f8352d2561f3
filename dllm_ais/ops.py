"""Small tensor helpers shared by the correction and loss stages.

Token tensors are [B, L]; a `mask` (bool or 0/1) marks the valid completion tokens. Reductions skip invalid
entries entirely, so inf or NaN stored there never reaches a result.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "as_token_mask",
    "broadcast_advantages",
    "check_choice",
    "masked_mean",
    "masked_sum",
    "normalised_effective_sample_size",
    "scalars_to_floats",
]


def check_choice(name: str, value: str, options: tuple[str, ...]) -> None:
    """Raise ValueError naming `name`, the bad value and the valid options unless value ∈ options."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")


def as_token_mask(mask: Tensor, *token_tensors: Tensor) -> Tensor:
    """Return `mask` as bool after checking it is [B, L] and every token tensor has its shape."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, length]; got shape {tuple(mask.shape)}")
    for tensor in token_tensors:
        if tensor.shape != mask.shape:
            raise ValueError(
                f"token tensors must match the mask's shape {tuple(mask.shape)}; "
                f"got {tuple(tensor.shape)}"
            )
    return mask.bool()


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ_{i: m_i} x_i over all entries (dim=None) or along `dim`; invalid entries never enter the
    sum, even when they are inf or NaN."""
    selected = torch.where(mask.bool(), values, 0.0)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ_i m_i x_i / max(1, Σ_i m_i): the mean over valid entries, 0 where there are none."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def scalars_to_floats(scalars: dict[str, Tensor]) -> dict[str, float]:
    """Turn 0-d tensors into python floats with a single device synchronisation."""
    values = torch.stack([value.float() for value in scalars.values()]).tolist()
    return dict(zip(scalars, values))


def broadcast_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Â_t = A_b for every token t of sequence b: detached float32 [B, L], 0 at invalid positions."""
    valid = mask.bool()
    if advantages.shape != valid.shape[:1]:
        raise ValueError(
            f"advantages must be [batch] = ({valid.shape[0]},), one per sequence; "
            f"got shape {tuple(advantages.shape)}"
        )
    return torch.where(valid, advantages.detach().float().unsqueeze(1), 0.0)


def normalised_effective_sample_size(weights: Tensor, mask: Tensor) -> Tensor:
    """(Σ w)² / (N · Σ w²) = mean(w)² / mean(w²) over the N valid entries, in (0, 1];
    1 when there is nothing to weigh (N = 0 or all weights 0)."""
    second_moment = masked_mean(weights.square(), mask)
    return torch.where(
        second_moment > 0, masked_mean(weights, mask).square() / second_moment, 1.0
    )
