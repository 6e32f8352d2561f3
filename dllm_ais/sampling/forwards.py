"""The sampling forwards a sampler runs its model through, owned by whoever samples: `EagerForwards` (the model called
as it is: the trainer's model, an uncompiled engine's) or the compiled rollout engine's `StaticForwards` (key/value
buffers allocated once per canvas and written in place, each forward signature captured once as a CUDA graph and
replayed: `rollout.compile`). `RolloutEngine` builds one and hands it to the samplers (``sample(..., forwards=)``);
a sampler given none runs `EagerForwards` of the model it samples.

A masked-diffusion rollout runs the same few forwards over and over: the full canvas (no cache, or a cache refresh),
the current block against the cache (dual), or the block and everything after it (prefix). Eagerly, each forward
launches a few hundred kernels from Python and the GPU waits on the launches; replayed as a CUDA graph, a forward is
one launch. What a graph needs, the forwards provide:

- fixed shapes: one graph per signature (input shape, padding mask or none, kept logit positions, cache or none),
  captured the first time the signature is met and replayed after; prompts padded to a few length buckets
  (`bucketed_prompt_length`) keep the signatures few across batches;
- fixed addresses: the inputs are copied into static tensors before a replay, and the key/value cache lives in
  buffers allocated once per (batch, canvas length): a refresh writes every position of them in place
  (``past_key_values`` = the buffers, ``cache_position`` = the whole canvas), which computes what the eager refresh
  computes (the fresh keys/values, attended to at once);
- no host synchronisation inside a forward (the models read no tensor value on the host).

Graphs are captured only on CUDA; elsewhere (and under autograd) the same calls run the model directly, buffers
included, so the CPU tests check the whole path but the capture. Regional compilation (`compile_blocks`: one compiled
transformer block, reused by every layer) fuses each block's elementwise work, the activation quantization of the
FP8 modes with it, into few kernels; compiled blocks run inside the graphs.

The autoregressive adapter's decode step is the same kind of forward: one token per row against a transformers
`StaticCache` (`decode_cache`: one per (batch, bucketed length), emptied and refilled in place by each call) under an
attention mask of the cache's whole length, so that every step of every call has one signature; the cache advances its
write offset in place, inside the graph.

Sampling only: the trainer's scoring forwards (with gradients, varying shapes) run the model as it is (`EagerForwards`).

Sharded forwards (`EagerForwards.shared`): a model sharded by FSDP2 (``fully_shard``: the unified precision flow's
engine, or the trainer's model in the decoder replay) gathers its weights on every process at each forward, so every
process must run the same number of forwards. The samplers decide that number from a few host reads of device values
(masked positions left, steps a block needed, whether every row has finished); each such read goes through
`EagerForwards.agreed` first, which makes it the same on every process: a count the maximum over the processes, a
"finished" flag their AND. A process whose rows are done runs the remaining forwards and commits nothing. Unsharded
(one process, DDP, the split engine's own copy), `agreed` is the identity and costs nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import StaticCache

from dllm_ais.models.sharding import agreed_across_processes, is_sharded
from dllm_ais.sampling.fp8_cache import FP8KeyValueCache, FP8KeyValueCacheRefresh

__all__ = ["PROMPT_BUCKET", "EagerForwards", "StaticForwards", "bucketed_prompt_length", "compile_blocks"]

PROMPT_BUCKET = 64  # prompts are left-padded to a multiple of this many tokens: one set of graphs per bucket
RECOMPILE_LIMIT = 64  # compiled variants of the block code torch keeps before falling back to eager
WARM_UP_CALLS = 2  # forwards run before a capture (on a side stream, as CUDA graphs require): compilation happens here

logger = logging.getLogger("dllm_ais")


def bucketed_prompt_length(length: int) -> int:
    """The prompt length a batch of prompts of `length` tokens is left-padded to: the next multiple of
    PROMPT_BUCKET."""
    return -(-length // PROMPT_BUCKET) * PROMPT_BUCKET


def compile_blocks(model: nn.Module) -> int:
    """Compile, in place, every transformer block of `model` (the classes its ``_no_split_modules`` names) with
    `torch.compile`: one compiled block serves every layer (regional compilation), so compiling takes seconds
    where the whole model would take minutes. Returns how many blocks were compiled."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_classes]
    # The blocks meet a few signatures each (refresh, cached step, padding mask or none, batch sizes) and every
    # engine's blocks share one code object: past torch's default limit they would silently run eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Fused kernels round their intermediates to the tensors' dtype as the eager ops do (not in float32 throughout),
    # so the compiled engine's numerics stay the eager engine's up to accumulation order.
    torch._inductor.config.emulate_precision_casts = True
    for block in blocks:
        block.compile()
    return len(blocks)


class EagerForwards:
    """A model's sampling forwards, run as the model is: `logits` one forward, `key_value_buffers` a forward that
    returns the keys/values it computed (a cache refresh). No static shapes: prompts are not bucketed, and a
    block-causal model's cache grows with the blocks decoded.

    `shared`: whether every process runs each forward together (None: whether the model is sharded, `is_sharded`,
    looked up at the first `agreed`, i.e. after the trainer has sharded it); the samplers' host reads that decide how
    many forwards run then go through `agreed` (the module docstring: sharded forwards)."""

    static_shapes = False

    def __init__(self, model: nn.Module, shared: bool | None = None):
        self.model = model
        self._shared = shared

    @property
    def shared(self) -> bool:
        """Whether the processes run every forward of this model together (an FSDP2-sharded model's)."""
        if self._shared is None:
            self._shared = is_sharded(self.model)
        return self._shared

    def agreed(self, values: torch.Tensor, op: str | Sequence[str] = "max") -> torch.Tensor:
        """`values` [N] (device integers or bools about to be read on the host to decide how many forwards run) as
        every process sharing the forwards reads them: with `shared`, the maximum over the processes of each count
        (`op` "max") and the AND of each flag ("min"), one name or one per value (`agreed_across_processes`: one
        all-reduce over the default process group); `values` themselves otherwise. Every process calls it at the same
        point of its loop, as it runs the same forwards."""
        return agreed_across_processes(values, op) if self.shared else values

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               logits_to_keep: torch.Tensor | int, past_key_values: Any = None,
               cache_position: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, K, V] of ``model(input_ids, attention_mask=…, logits_to_keep=…, past_key_values=…,
        cache_position=…, position_ids=…)`` (the inputs given as None left out)."""
        return _forward_logits(self.model, _given_inputs(input_ids, attention_mask, logits_to_keep, cache_position,
                                                         position_ids), past_key_values)

    def key_value_buffers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          logits_to_keep: torch.Tensor, storage: str = "none") -> tuple[Any, torch.Tensor]:
        """(keys/values, logits [B, K, V] at `logits_to_keep`) of a forward over the canvas `input_ids` [B, T] with
        ``use_cache=True``: the keys/values as the model returns them (`storage` "none") or stored in FP8
        (`FP8KeyValueCache`)."""
        output = self.model(input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=logits_to_keep)
        stored = FP8KeyValueCache(output.past_key_values) if storage == "fp8" else output.past_key_values
        return stored, output.logits

    def block_causal_buffers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             block: slice) -> tuple[Any, torch.Tensor]:
        """(keys/values, logits [B, Lb, V] of `block`) of a block-causal model's first forward of a canvas
        `input_ids` [B, T]: positions [0, block.stop) run, their keys/values kept in buffers of the canvas length
        (zero past block.stop until written: a block never attends to a later one)."""
        stop = block.stop
        positions = torch.arange(block.start, stop, device=input_ids.device)
        output = self.model(input_ids[:, :stop], use_cache=True, logits_to_keep=positions,
                            attention_mask=None if attention_mask is None else attention_mask[:, :stop])
        room = input_ids.shape[1] - stop
        return [tuple(F.pad(tensor, (0, 0, 0, room)) for tensor in layer) for layer in output.past_key_values], \
            output.logits

    def cached_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    logits_to_keep: torch.Tensor, past_key_values: Any,
                    cache_position: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(logits, keys/values) of a forward of `input_ids` [B, K] at `cache_position` against `past_key_values`,
        writing its own keys/values there: the model's returned cache (the buffers, or, under grad, their written
        copy)."""
        output = self.model(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                            past_key_values=past_key_values, cache_position=cache_position, use_cache=True)
        return output.logits, output.past_key_values


class StaticForwards(EagerForwards):
    """A model's no-gradient forwards at static shapes: `logits` runs one (replaying its CUDA graph on a CUDA device),
    `key_value_buffers` holds the diffusion cache buffers per (batch, canvas length, storage), `decode_cache` the
    autoregressive decoding's `StaticCache` per (batch, length).

    The logits returned are a fresh tensor; the buffers are written in place by every cached forward.
    """

    static_shapes = True

    def __init__(self, model: nn.Module, cuda_graphs: bool):
        super().__init__(model)
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple, _CapturedForward] = {}
        self.buffers: dict[tuple[int, int, str], Any] = {}
        self.decode_caches: dict[tuple[int, int], StaticCache] = {}
        self.pool = None  # the CUDA graphs' shared memory pool, made at the first capture

    def key_value_buffers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          logits_to_keep: torch.Tensor, storage: str = "none") -> tuple[Any, torch.Tensor]:
        """(buffers, logits) of a cache refresh of the canvas `input_ids` [B, T]: the buffers hold the keys/values in
        the model's dtype (`storage` "none": one (keys, values) pair per layer) or in FP8 ("fp8": an
        `FP8KeyValueCache`). The first refresh at a (B, T, storage) runs the model with ``use_cache=True`` and keeps
        the keys/values it returns as those buffers; later ones write every position of them in place (`logits`;
        in FP8 through the cache's `refresh` side, quantized after the forward). Logits [B, K, V] at
        `logits_to_keep` [K]."""
        key = (*input_ids.shape, storage)
        if key not in self.buffers:
            output = self.model(input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=logits_to_keep)
            pairs = [tuple(layer) for layer in output.past_key_values]
            self.buffers[key] = FP8KeyValueCache(pairs) if storage == "fp8" else pairs
            return self.buffers[key], output.logits
        buffers = self.buffers[key]
        written = buffers.refresh if storage == "fp8" else buffers
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return buffers, self.logits(input_ids, attention_mask, logits_to_keep, written, positions)

    def block_causal_buffers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                             block: slice) -> tuple[Any, torch.Tensor]:
        """The buffers of a block-causal model's canvas `input_ids` [B, T] at static shape: the whole canvas run into
        them (`key_value_buffers`; the positions after `block` then hold keys/values of masks, rewritten before a
        later block reads them), and the logits of `block`."""
        return self.key_value_buffers(input_ids, attention_mask,
                                      torch.arange(block.start, block.stop, device=input_ids.device))

    def cached_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    logits_to_keep: torch.Tensor, past_key_values: Any,
                    cache_position: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(logits, the buffers) of a forward written into the buffers in place (`logits`: a captured graph on a
        GPU)."""
        return self.logits(input_ids, attention_mask, logits_to_keep, past_key_values, cache_position), past_key_values

    def decode_cache(self, batch: int, length: int) -> StaticCache:
        """An empty `StaticCache` of `batch` rows and room for `length` tokens (prompt and completion): one per
        (batch, length), allocated at its first prefill and emptied in place (`reset`) for each later call, so that
        the decode steps' graphs, captured against it, stay valid."""
        cache = self.decode_caches.get((batch, length))
        if cache is None:
            cache = self.decode_caches[(batch, length)] = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            cache.reset()
        return cache

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               logits_to_keep: torch.Tensor | int, past_key_values: Any = None,
               cache_position: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, K, V] of ``model(input_ids, attention_mask=…, logits_to_keep=…, past_key_values=…,
        cache_position=…, position_ids=…)`` (the inputs given as None left out): a replay of the signature's CUDA
        graph (captured at its first call) when graphs are on, the model itself otherwise."""
        inputs = _given_inputs(input_ids, attention_mask, logits_to_keep, cache_position, position_ids)
        if not self.cuda_graphs:
            return _forward_logits(self.model, inputs, past_key_values)
        key = (id(past_key_values),) + tuple(
            (name, tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else (name, value)
            for name, value in inputs.items())
        graph = self.graphs.get(key)
        if graph is None:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            try:
                graph = self.graphs[key] = _CapturedForward(self.model, inputs, past_key_values, self.pool)
            except RuntimeError as error:  # e.g. a forward that reads a tensor's value on the host
                self.cuda_graphs = False
                logger.warning("the rollout engine's forward cannot be captured as a CUDA graph (%s); its sampling "
                               "forwards run without graphs from now on.", str(error).splitlines()[0] if str(error)
                               else type(error).__name__)
                return _forward_logits(self.model, inputs, past_key_values)
        return graph.replay(inputs)


def _given_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, logits_to_keep: torch.Tensor | int,
                  cache_position: torch.Tensor | None, position_ids: torch.Tensor | None) -> dict[str, Any]:
    """The forward's keyword inputs, those given as None left out."""
    return {name: value for name, value in (
        ("input_ids", input_ids), ("attention_mask", attention_mask), ("logits_to_keep", logits_to_keep),
        ("cache_position", cache_position), ("position_ids", position_ids)) if value is not None}


def _forward_logits(model: nn.Module, inputs: dict[str, Any], past_key_values: Any) -> torch.Tensor:
    """The logits of ``model(**inputs, past_key_values=past_key_values)`` (a model may return them bare), and an FP8
    refresh's working pairs quantized into its cache after the forward (`FP8KeyValueCacheRefresh.store_written`)."""
    output = model(**inputs) if past_key_values is None else model(**inputs, past_key_values=past_key_values)
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(past_key_values, FP8KeyValueCacheRefresh):
        past_key_values.store_written()
    return logits


def _write_offsets(past_key_values: Any) -> list[torch.Tensor]:
    """The write offsets a cache advances in place at every forward (a `StaticCache` layer's `cumulative_length`);
    none for the diffusion buffers, which are written at the positions each forward is given."""
    offsets = (getattr(layer, "cumulative_length", None) for layer in getattr(past_key_values, "layers", ()))
    return [offset for offset in offsets if isinstance(offset, torch.Tensor)]


class _CapturedForward:
    """One forward signature captured as a CUDA graph: static copies of its inputs, the logits it writes."""

    def __init__(self, model: nn.Module, inputs: dict[str, Any], past_key_values: Any, pool: Any):
        self.static_inputs = {name: value.clone() if isinstance(value, torch.Tensor) else value
                              for name, value in inputs.items()}

        def forward() -> torch.Tensor:
            return _forward_logits(model, self.static_inputs, past_key_values)

        offsets = _write_offsets(past_key_values)
        offsets_before = [offset.clone() for offset in offsets]
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(WARM_UP_CALLS):
                forward()
            for offset, before in zip(offsets, offsets_before):  # the warm-ups' writes are not steps of the call
                offset.copy_(before)
        torch.cuda.current_stream().wait_stream(side_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward()

    def replay(self, inputs: dict[str, Any]) -> torch.Tensor:
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                self.static_inputs[name].copy_(value)
        self.graph.replay()
        return self.logits.clone()
