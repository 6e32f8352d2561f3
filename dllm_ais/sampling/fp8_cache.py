"""FP8 storage of the block KV cache (`DiffusionSamplerConfig.cache_dtype="fp8"`).

A refreshing forward's keys and values, [B, H, T, D] per layer, are stored as e4m3 with one scale per batch row and
head (the numerics of torchao's float8 reference primitives at block size [1, 1, T, D]):

    s_bh = max(max_{t,d} |x_bhtd|, 1e-12) / 448,    q_bhtd = e4m3(clamp(x_bhtd / s_bh, −448, 448)),

and read back as x̂_bhtd = float32(q_bhtd) · s_bh in the model's dtype. Each read dequantizes one layer into a fresh
tensor: the model writes the current block's fresh keys/values into that copy (`index_copy_`), and since every
position a cached forward writes is written again by the next one before it attends, nothing written is lost.
The compiled engine's static forwards keep one such cache per canvas shape and refresh it in place: a refreshing forward
writes the whole canvas into working pairs in the model's dtype (`FP8KeyValueCacheRefresh`), then quantizes them into
the cache's storage (`store_`), so that a CUDA graph of either forward reads and writes the same buffers each replay.
Sampling only: `MaskedDiffusionSampler.decoder_logits` (the trainer's replay) keeps the cache in the model's dtype.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cached_property

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
AMAX_FLOOR = 1e-12  # an all-zero head (e.g. a padded row) would otherwise get scale 0 and turn into NaN

__all__ = ["FP8KeyValueCache", "FP8KeyValueCacheRefresh", "dequantize_per_head", "quantize_per_head"]


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

    def store_(self, past_key_values: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Quantize `past_key_values` (one (keys, values) pair per layer, of this cache's shapes) into this cache's
        storage, in place."""
        for stored_pair, pair in zip(self.layers, past_key_values):
            for (stored, stored_scale), tensor in zip(stored_pair, pair):
                quantized, scale = quantize_per_head(tensor)
                stored.copy_(quantized)
                stored_scale.copy_(scale)

    @cached_property
    def refresh(self) -> "FP8KeyValueCacheRefresh":
        """The cache's write side for a forward that rewrites every position (`FP8KeyValueCacheRefresh`)."""
        return FP8KeyValueCacheRefresh(self)


class FP8KeyValueCacheRefresh(Sequence):
    """The `past_key_values` of a forward that writes every position of every layer of an `FP8KeyValueCache` (a refresh
    over the whole canvas): a layer read returns a working (keys, values) pair in the model's dtype, the same pair at
    every read within a forward, for the forward to write into and attend to; `store_written` then quantizes the pairs
    into the cache in place."""

    def __init__(self, cache: FP8KeyValueCache):
        self.cache = cache
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.written:
            (keys, _), (values, _) = self.cache.layers[index]
            self.written[index] = (torch.empty(keys.shape, dtype=self.cache.dtype, device=keys.device),
                                   torch.empty(values.shape, dtype=self.cache.dtype, device=values.device))
        return self.written[index]

    def store_written(self) -> None:
        """Quantize the pairs the forward wrote into the cache and forget them."""
        self.cache.store_(self.written[index] for index in range(len(self)))
        self.written.clear()
