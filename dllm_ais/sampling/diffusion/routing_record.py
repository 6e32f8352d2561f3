"""The rollout engine's expert selection recorded while sampling, and forced on the decoder replay's forwards
(`experimental.routing_record`; docs/algorithms.md, "Mixture-of-experts routing").

A mixture-of-experts model's routing is discrete: where the engine (a quantized copy, batch-scaled activations,
another batch) and the trainer's replay compute slightly different hidden states, a near-tie token goes to other
experts, and the ratio sees a different function rather than rounding. `EngineRouting`
(`dllm_ais.models.routing`) recomputes the engine's forward on the trainer's inputs, which is the sampled routing
only where that forward computes what sampling computed. Here the sampler records, while sampling, the experts each
(position, step, layer) used, and the decoder replay (`MaskedDiffusionSampler.decoder_logits`, `routing_replay`) forces those on every
forward it runs, whatever token set that forward covers:

- a position of the block a forward denoises, at global step g: the selection of step g's sampling forward
  (`RoutingRecord.step_selection`);
- a position before that block: the selection of the last sampling forward that computed it, the one that wrote the
  keys/values every later block reads (`RoutingRecord.final_selection`): with a block-causal model's exact cache, a
  finished block is recomputed with its final tokens by the next block's first forward, the prompt before the first
  block by the first forward. So the no-grad replay (ℓ_old), which runs sampling's forwards one for one, and the
  under-grad replay (ℓ_θ), which rebuilds the cache with one forward of [0, block.stop) at a block's first step, both
  route every token as sampling did.

Layout, per row (int16 expert ids, −1 where nothing was recorded): `step_selection` [S, Lb, layers, top_k] (S the
call's global steps, Lb the block length) and `final_selection` [T, layers, top_k] (T the sampler's canvas width),
plus `block_first_step` [n_blocks]. Bytes per row: 2 · layers · top_k · (S · Lb + T). At LLaDA2.0-mini's shape (20
MoE layers, top-8, block 32, gen 256 in 256 steps, a 256-token prompt: T = 512 + ≤ 32) that is 2 · 160 · (8192 + 544)
≈ 2.8 MB a row, ≈ 179 MB for a batch of 64 (computed, not measured); 128 steps halve the first term (≈ 95 MB). A
[T, steps, layers, top_k] record per row would be 2 · 160 · 544 · 256 ≈ 44.6 MB a row (2.9 GB at 64).

The hook (`dllm_ais.models.routing.PositionedRouting`) is a forward pre-/post-hook on the model around each sampling
forward and each replay forward, reading the positions a forward computes from its `cache_position` (the whole input
when absent); each routed layer's `routing_tape` hands it the layer's selection and takes the forced one. Python runs
inside every forward, so recording needs the eager engine (`rollout.compile=false`: a captured CUDA graph would not
call it); the sampler keeps its log on the device and stacks it once at the end (no host read per step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from dllm_ais.models.routing import PositionedRouting, RoutingTape, routed_layers
from dllm_ais.sampling.diffusion.canvas import CanvasLayout
from dllm_ais.sampling.diffusion.sampler_config import DiffusionSamplerConfig, SpecialTokenIds
from dllm_ais.sampling.forwards import EagerForwards

__all__ = ["ROUTING", "RecordedRouting", "RoutingLog", "RoutingRecord", "routing_log"]

ROUTING = "routing"
"""The name of the routing record in `Rollout.records`."""

NOT_RECORDED = -1


@dataclass
class RoutingRecord:
    """The experts a sampling call's forwards used, held in `Rollout.records` under `ROUTING` (module docstring).

    step_selection [B, S, Lb, layers, top_k] int16: at global step g (the numbering of `Rollout.commit_step`), the
    experts of each position of the block that step denoised (canvas position block.start + i of the sampler's
    canvas); final_selection [B, T, layers, top_k] int16: per canvas position, the experts of the last forward that
    computed it before the block it was in (its final keys/values; −1 for the last block's positions, which no later
    block reads); block_first_step [B, n_blocks]: the global step of each block's first forward (−1: none).
    """

    step_selection: Tensor
    final_selection: Tensor
    block_first_step: Tensor

    @staticmethod
    def joined(parts: list["RoutingRecord"]) -> "RoutingRecord":
        """The parts' records as one (rows in order), the step axis padded (−1) to the most steps of any part."""
        steps = max(part.step_selection.shape[1] for part in parts)
        padded = [torch.nn.functional.pad(part.step_selection, (0, 0, 0, 0, 0, 0, 0, steps - part.step_selection.shape[1]),
                                          value=NOT_RECORDED) for part in parts]
        return RoutingRecord(torch.cat(padded), *(torch.cat([getattr(part, f.name) for part in parts])
                                                  for f in fields(RoutingRecord)[1:]))


class RoutingLog:
    """The routing of one sampling call as it happens: `forward(step, block)` wraps the sampling forward of global
    step `step` denoising `block`; `record()` assembles the `RoutingRecord` (one stack, no host read)."""

    def __init__(self, model: nn.Module, blocks: list[slice], canvas_length: int):
        self.model, self.blocks, self.canvas_length = model, blocks, canvas_length
        self.layers = len(routed_layers(model))
        if not self.layers:
            raise ValueError(f"record_routing: {type(model).__name__} has no mixture-of-experts layer to record")
        self.steps: list[Tensor] = []
        self.final: Tensor | None = None  # [B, T + 1, layers, top_k]: the last slot takes what is not stored
        self.block_first_step = [NOT_RECORDED] * len(blocks)

    def forward(self, step: int, block: slice) -> PositionedRouting:
        """The context of global step `step`'s forward (the sampler's one forward per step)."""
        if step != len(self.steps):
            raise ValueError(f"record_routing: the forward of step {step} follows {len(self.steps)} recorded steps: "
                             "the sampler runs one forward per step")
        index = self.blocks.index(block)
        if self.block_first_step[index] == NOT_RECORDED:
            self.block_first_step[index] = step
        return PositionedRouting(self.model, lambda positions, rows: RoutingTape(),
                                 lambda tape, positions, rows: self._file(tape, positions, rows, block))

    def _file(self, tape: RoutingTape, positions: Tensor, rows: int, block: slice) -> None:
        selection = torch.stack(tape.used, dim=1).view(rows, len(positions), self.layers, -1).to(torch.int16)
        if self.final is None:
            self.final = selection.new_full((rows, self.canvas_length + 1, *selection.shape[2:]), NOT_RECORDED)
        length = block.stop - block.start
        in_block = (positions >= block.start) & (positions < block.stop)
        current = selection.new_full((rows, length + 1, *selection.shape[2:]), NOT_RECORDED)
        current.index_copy_(1, torch.where(in_block, positions - block.start, length), selection)
        self.steps.append(current[:, :length])
        self.final.index_copy_(1, torch.where(positions < block.start, positions, self.canvas_length), selection)

    def record(self, rows: int, device: torch.device) -> RoutingRecord:
        """The call's `RoutingRecord` (S = 0 when no forward ran)."""
        first = torch.tensor(self.block_first_step, dtype=torch.long, device=device).expand(rows, -1).clone()
        if not self.steps:
            empty = torch.empty((rows, 0, 0, self.layers, 0), dtype=torch.int16, device=device)
            return RoutingRecord(empty, empty[:, 0], first)
        return RoutingRecord(torch.stack(self.steps, dim=1), self.final[:, :self.canvas_length].clone(), first)


class _ForcedTape(RoutingTape):
    """A forced tape whose −1 rows (no recorded selection) route by the layer's own router, counted in
    `unrecorded` (tokens × layers, on the device)."""

    def __init__(self, forced: list[Tensor]):
        super().__init__(forced)
        self.unrecorded = torch.zeros((), dtype=torch.long, device=forced[0].device)

    def _forced(self, call: int, own: Tensor) -> Tensor:
        forced = super()._forced(call, own)
        missing = (forced < 0).any(dim=-1, keepdim=True)
        self.unrecorded = self.unrecorded + missing.sum()
        return torch.where(missing, own, forced)


class RecordedRouting:
    """A rollout's `RoutingRecord` forced on the decoder replay's forwards: `forward(block_index, block, steps)` wraps
    the replay forward of `block` (the `block_index`-th of the canvas layout) at each row's global step `steps` [B]
    (−1 where a row has none); every token of it routes to the recorded experts (module docstring: a block position
    at its step, an earlier position at its final forward). `unrecorded` counts the (token, layer) pairs the record
    held nothing for (routed by the model's own router; 0 when the replay runs the sampler's forwards). With
    `keep_tapes`, `tapes` keeps every forward's tape (`own` and `used` per routed layer, and its `block`, rows'
    `steps` and `positions`), for checks."""

    def __init__(self, model: nn.Module, record: RoutingRecord, keep_tapes: bool = False):
        if record.final_selection.shape[-1] == 0 or not routed_layers(model):
            raise ValueError("routing record: nothing recorded, or a model without mixture-of-experts layers to "
                             "force it on")
        self.model, self.record, self.keep_tapes = model, record, keep_tapes
        self.layers = record.final_selection.shape[2]
        self.unrecorded = torch.zeros((), dtype=torch.long, device=record.final_selection.device)
        self.tapes: list[_ForcedTape] = []

    def forward(self, block_index: int, block: slice, step: int, first: Tensor, started: Tensor) -> PositionedRouting:
        """The context of the replay forward of `block` (the `block_index`-th of the canvas layout) at its `step`,
        counted per row from `first` [B] (the row's first commit in the block; where `started` [B] is False, a row
        with no completion position in the block, from the block's first sampling forward)."""
        origin = self.record.block_first_step[:, block_index].to(first.device)
        steps = torch.where(started, first, origin) + step
        steps = torch.where(started | (origin >= 0), steps, NOT_RECORDED)
        return PositionedRouting(self.model, lambda positions, rows: self._tape(positions, rows, block, steps),
                                 self._done)

    def _tape(self, positions: Tensor, rows: int, block: slice, steps: Tensor) -> _ForcedTape:
        record = self.record
        if rows != record.final_selection.shape[0]:
            raise ValueError(f"routing record: a replay forward of {rows} rows against a record of "
                             f"{record.final_selection.shape[0]}: replay the rollout that was recorded, without "
                             "guidance (cfg_scale=0)")
        positions = positions.to(record.final_selection.device)
        steps = steps.to(positions.device)
        step_count, length, canvas_length = (record.step_selection.shape[1], record.step_selection.shape[2],
                                              record.final_selection.shape[1])
        valid_step = (steps >= 0) & (steps < step_count)
        in_block = (positions >= block.start) & (positions < block.stop)
        at_step = record.step_selection[torch.arange(rows, device=positions.device)[:, None],
                                        steps.clamp(0, max(step_count - 1, 0))[:, None],
                                        (positions - block.start).clamp(0, length - 1)[None, :]]
        at_step = at_step.masked_fill(~valid_step[:, None, None, None], NOT_RECORDED)
        final = record.final_selection[:, positions.clamp(0, canvas_length - 1)]
        final = final.masked_fill((positions >= canvas_length)[None, :, None, None], NOT_RECORDED)
        selection = torch.where(in_block[None, :, None, None], at_step, final)
        selection = selection.masked_fill((positions >= block.stop)[None, :, None, None], NOT_RECORDED).long()
        tape = _ForcedTape([selection[:, :, layer].reshape(rows * len(positions), -1) for layer in range(self.layers)])
        tape.block, tape.steps, tape.positions = block, steps, positions
        return tape

    def _done(self, tape: _ForcedTape, positions: Tensor, rows: int) -> None:
        self.unrecorded = self.unrecorded + tape.unrecorded
        if self.keep_tapes:
            self.tapes.append(tape)


def routing_log(config: DiffusionSamplerConfig, forwards: EagerForwards, layout: CanvasLayout,
                token_ids: SpecialTokenIds) -> RoutingLog | None:
    """The log of a sampling call's expert selection with `config.record_routing`, else None. ValueError where the
    record would not key the replay's forwards: a model that is not block-causal or no block cache (the record is
    keyed for the block-causal exact cache's forwards), guidance (a doubled batch), static shapes (the compiled
    engine's graphs run no Python hook)."""
    if not config.record_routing:
        return None
    if not token_ids.block_causal or config.cache == "none" or config.cfg_scale > 0:
        raise ValueError("record_routing records a block-causal model's (LLaDA2's) routing along its exact block "
                         "cache, without guidance: set rollout.cache, cfg_scale=0, or record_routing=false")
    if forwards.static_shapes:
        raise ValueError("record_routing hooks every routed layer's call, which a compiled engine's captured "
                         "graphs never make: set rollout.compile=false")
    return RoutingLog(forwards.model, layout.blocks, layout.canvas.shape[1])
