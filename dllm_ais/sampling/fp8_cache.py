"""FP8 storage of the block KV cache (`DiffusionSamplerConfig.cache_dtype="fp8"`).

A refreshing forward's keys and values, [B, H, T, D] per layer, are stored as e4m3 with one scale per batch row and
head (the numerics of torchao's float8 reference primitives at block size [1, 1, T, D]):

    s_bh = max(max_{t,d} |x_bhtd|, 1e-12) / 448,    q_bhtd = e4m3(clamp(x_bhtd / s_bh, −448, 448)),

and read back as x̂_bhtd = float32(q_bhtd) · s_bh in the model's dtype. Each read dequantizes one layer into a fresh
tensor: the model writes the current block's fresh keys/values into that copy (`index_copy_`), and since every
position a cached forward writes is written again by the next one before it attends, nothing written is lost.
Sampling only: `MaskedDiffusionSampler.decoder_logits` (the trainer's replay) keeps the cache in the model's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
AMAX_FLOOR = 1e-12  # an all-zero head (e.g. a padded row) would otherwise get scale 0 and turn into NaN

__all__ = ["FP8KeyValueCache", "dequantize_per_head", "quantize_per_head"]


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, T, D] → (q [B, H, T, D] float8_e4m3fn, s [B, H, 1, 1] float32) with s = max(amax_bh, 1e-12) / 448
    and q = e4m3(clamp(x / s, ±448))."""
    scale = x.abs().amax(dim=(-2, -1), keepdim=True).float().clamp(min=AMAX_FLOOR) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_per_head(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) · s, cast to `dtype`."""
    return (q.float() * scale).to(dtype)


class FP8KeyValueCache(Sequence):
    """A model's `past_key_values` (one (keys, values) pair per layer) stored in FP8 per (row, head); indexing a layer
    returns its pair dequantized to the original dtype (a fresh pair per access)."""

    def __init__(self, past_key_values: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self.dtype = past_key_values[0][0].dtype
        self.layers = [(quantize_per_head(keys), quantize_per_head(values)) for keys, values in past_key_values]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layers[index]
        return dequantize_per_head(*keys, self.dtype), dequantize_per_head(*values, self.dtype)
