"""The rollout engine's sampling forwards at static shapes: key/value buffers allocated once per canvas and written in
place, each forward signature captured once as a CUDA graph and replayed (`rollout.compile`).

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

Sampling only: the trainer's scoring forwards (with gradients, varying shapes) run the model as it is.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

__all__ = ["PROMPT_BUCKET", "StaticForwards", "bucketed_prompt_length", "compile_blocks", "static_forwards_of"]

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


def static_forwards_of(model: Any) -> "StaticForwards | None":
    """The `StaticForwards` the rollout engine attached to `model`, when a sampling forward may use them: no
    gradients are being recorded (the trainer's scoring forwards never use them)."""
    forwards = getattr(model, "static_forwards", None)
    return forwards if forwards is not None and not torch.is_grad_enabled() else None


class StaticForwards:
    """A model's no-gradient forwards at static shapes: `logits` runs one (replaying its CUDA graph on a CUDA device),
    `key_value_buffers` holds the cache buffers per (batch, canvas length).

    The logits returned are a fresh tensor; the buffers are written in place by every cached forward.
    """

    def __init__(self, model: nn.Module, cuda_graphs: bool):
        self.model = model
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple, _CapturedForward] = {}
        self.buffers: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None  # the CUDA graphs' shared memory pool, made at the first capture

    def key_value_buffers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          logits_to_keep: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """(buffers, logits) of a cache refresh of the canvas `input_ids` [B, T]: the first refresh at a (B, T) runs
        the model with ``use_cache=True`` and keeps the keys/values it returns as that shape's buffers; later ones
        write every position of those buffers in place (`logits`). Logits [B, K, V] at `logits_to_keep` [K]."""
        key = tuple(input_ids.shape)
        if key not in self.buffers:
            output = self.model(input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=logits_to_keep)
            self.buffers[key] = [tuple(layer) for layer in output.past_key_values]
            return self.buffers[key], output.logits
        buffers = self.buffers[key]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return buffers, self.logits(input_ids, attention_mask, logits_to_keep, buffers, positions)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, logits_to_keep: torch.Tensor,
               past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               cache_position: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, K, V] of ``model(input_ids, attention_mask=…, logits_to_keep=…, past_key_values=…,
        cache_position=…)``: a replay of the signature's CUDA graph (captured at its first call) when graphs are on,
        the model itself otherwise."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep,
                  "cache_position": cache_position}
        if not self.cuda_graphs:
            return self.model(**inputs, past_key_values=past_key_values).logits
        key = (id(past_key_values),) + tuple(None if value is None else (tuple(value.shape), value.dtype)
                                             for value in inputs.values())
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
                return self.model(**inputs, past_key_values=past_key_values).logits
        return graph.replay(inputs)


class _CapturedForward:
    """One forward signature captured as a CUDA graph: static copies of its inputs, the logits it writes."""

    def __init__(self, model: nn.Module, inputs: dict[str, torch.Tensor | None],
                 past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None, pool: Any):
        self.static_inputs = {name: None if value is None else value.clone() for name, value in inputs.items()}

        def forward() -> torch.Tensor:
            return model(**self.static_inputs, past_key_values=past_key_values).logits

        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(WARM_UP_CALLS):
                forward()
        torch.cuda.current_stream().wait_stream(side_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward()

    def replay(self, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
        for name, value in inputs.items():
            if value is not None:
                self.static_inputs[name].copy_(value)
        self.graph.replay()
        return self.logits.clone()
