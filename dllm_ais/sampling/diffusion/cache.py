"""The block KV cache of one sampling call (Fast-dLLM's prefix and dual caches, a block-causal model's exact cache of
finished blocks): which forward refreshes it and which reads it. The keys/values themselves are allocated and written
by the sampler's forwards (`dllm_ais.sampling.forwards`: the model as it is, or the compiled engine's static buffers,
in the model's dtype or FP8), the one owner of their storage; a `BlockCache` holds the handle for one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dllm_ais.models.families import logit_source_positions
from dllm_ais.sampling.forwards import EagerForwards

__all__ = ["BLOCK_CAUSAL_CACHE", "BlockCache", "forward_logits"]

BLOCK_CAUSAL_CACHE = "block_causal"
"""`BlockCache.mode` of a block-causal model's exact cache of finished blocks (whatever `config.cache` names)."""


def forward_logits(forwards: EagerForwards, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   positions: slice | torch.Tensor, logits_shifted: bool = False) -> torch.Tensor:
    """Logits [B, K, V] predicting `positions`, a slice (sampling: the current block) or a 1-D position tensor
    (scoring), without a cache: one forward of `forwards` with ``logits_to_keep`` those positions, so that the LM head
    runs at them only; for a shifted family one position earlier (`dllm_ais.models.families.logit_source_positions`;
    a completion block starts after the prompt, so its predecessor exists)."""
    if isinstance(positions, slice):
        positions = torch.arange(positions.start, positions.stop, device=input_ids.device)
    return forwards.logits(input_ids, attention_mask, logit_source_positions(positions, logits_shifted))


@dataclass
class BlockCache:
    """The block KV cache of one `sample` call: the model's cached keys/values and whether the next forward refreshes
    them (the first step of each block, and every `cache_refresh_interval` steps).

    mode: "prefix" or "dual"; dtype: the storage, "none" (as the model returns it) or "fp8" (`FP8KeyValueCache`);
    past_key_values: what the last refreshing forward returned, so stored.

    mode `BLOCK_CAUSAL_CACHE` is a block-causal model's exact cache instead (`block_causal_forward`): never
    refreshed; `stored_until` is the canvas position up to which it holds the keys/values of finished blocks.
    """

    mode: str
    dtype: str = "none"
    past_key_values: Any = None
    refresh: bool = True
    stored_until: int = 0

    def block_forward(self, forwards: EagerForwards, inputs: torch.Tensor, attention_mask: torch.Tensor | None,
                      block: slice, logits_shifted: bool = False) -> torch.Tensor:
        """Logits [B, Lb, V] predicting the `block` positions of `inputs` [B, T] (for a shifted family, those computed
        one position earlier: `dllm_ais.models.families`).

        A refreshing forward runs the whole canvas and keeps its keys/values (its logits, computed at the block only,
        are those of the uncached forward). Otherwise the model runs on positions [start, T) (prefix) or
        [start, block.stop) (dual) only, at their absolute positions, attending to the cached keys/values elsewhere;
        start is block.start, or block.start − 1 for a shifted family, whose first block position is predicted there.
        """
        if self.mode == BLOCK_CAUSAL_CACHE:
            return self.block_causal_forward(forwards, inputs, attention_mask, block)
        positions = torch.arange(block.start, block.stop, device=inputs.device)
        sources = logit_source_positions(positions, logits_shifted)
        if self.refresh:
            self.past_key_values = None  # frees the previous block's cache before the new one is built
            self.past_key_values, logits = forwards.key_value_buffers(inputs, attention_mask, sources, self.dtype)
            return logits
        start = block.start - 1 if logits_shifted else block.start
        stop = inputs.shape[1] if self.mode == "prefix" else block.stop
        return forwards.logits(inputs[:, start:stop], attention_mask, sources - start, self.past_key_values,
                               torch.arange(start, stop, device=inputs.device))

    def block_causal_forward(self, forwards: EagerForwards, inputs: torch.Tensor,
                             attention_mask: torch.Tensor | None, block: slice) -> torch.Tensor:
        """Logits [B, Lb, V] of the `block` positions of a block-causal model's canvas `inputs` [B, T], every position
        before `block` holding its final token (the blocks are decoded in order).

        The first call has `forwards` build the keys/values buffers of the canvas length (`block_causal_buffers`:
        positions [0, block.stop) eagerly; the whole canvas into the compiled engine's static buffers). Every later
        call runs [`stored_until`, block.stop) against them, writing those positions (`cached_step`): the current
        block alone, or, at a block's first step, also the block finished before it, whose clean keys/values are
        stored so. The block's own keys/values, written while it is still masked, are rewritten by the next block's
        first forward before any later block reads them; the logits are those of the full block-causal forward.
        Under grad (a replay) the model writes into copies of the buffers, which the cache keeps instead.
        """
        if self.past_key_values is None:
            self.past_key_values, logits = forwards.block_causal_buffers(inputs, attention_mask, block)
        else:
            start = self.stored_until
            positions = torch.arange(block.start, block.stop, device=inputs.device)
            logits, self.past_key_values = forwards.cached_step(
                inputs[:, start:block.stop], attention_mask, positions - start, self.past_key_values,
                torch.arange(start, block.stop, device=inputs.device))
        self.stored_until = block.start
        return logits
