"""Routing record and replay for mixture-of-experts models: which experts each token went to, and forcing a
recorded choice on a later forward.

A routed layer is any module with a `routing_tape` attribute (LLaDA2's `LLaDA2MoeSparseMoeBlock`); while a
`RoutingTape` is set there, the layer hands it its router's own selection [N, top_k] on every call and uses the
expert ids the tape returns. The weights stay the layer's own: its unbiased router scores at the experts used
(`dllm_ais.models.llada2` module docstring: why they are recomputed, not replayed).

- `routing_tape(model, tape)`: set `tape` on every routed layer of `model` for the duration of a `with` block.
- `EngineRouting(trainer, engine, replay)`: while active, every forward of `trainer` first runs `engine` on the same
  inputs (no gradient) and records its selection; with `replay` the trainer then routes every token of every layer
  to the engine's experts (the rollout routing replay of the trainer's likelihood passes), without it by its own
  router (split routing, measured). Each forward's disagreement — whether a (token, layer)'s expert SET differs
  between the engine and the trainer's own router — is kept in `forwards`.

- `PositionedRouting(model, tape_for, done)`: each forward of `model` inside it routes through a tape made for the
  canvas positions it computes (`forward_positions`): the hook the sampler's routing record and its forced replay
  sit on (`dllm_ais.sampling.diffusion.routing_record`).

`EngineRouting`'s engine forward is recomputed on the trainer's inputs, so the replayed routing is the sampled one only
where that forward computes what sampling computed: the trajectory estimator's replay of the decoder's own canvases,
without a block cache, at a notch whose activation scales do not span the batch (`choices.routing_replay_problem`;
measured by `dllm-ais bench routing`). The recorded routing (`experimental.routing_record`) has the engine record its
selection while sampling and the decoder replay force it: exact with the block cache and at any notch.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

__all__ = ["EngineRouting", "PositionedRouting", "ReplayedForward", "RoutingTape", "forward_positions", "routed_layers",
           "routing_tape", "selection_differs"]


class RoutingTape:
    """The expert selections of a model's routed-layer calls, in call order.

    `own` collects the selection [N, top_k] each call's router made, `used` the experts the call used. With
    `forced` (one [N, top_k] per call, in the same order: another forward's `used`), each call uses the next forced
    selection instead of its own."""

    def __init__(self, forced: Sequence[Tensor] | None = None):
        self.own: list[Tensor] = []
        self.used: list[Tensor] = []
        self.forced = None if forced is None else list(forced)

    def route(self, own: Tensor) -> Tensor:
        """The experts the calling layer uses: the next forced selection, else `own` (both recorded)."""
        used = own if self.forced is None else self._forced(len(self.own), own)
        self.own.append(own.detach())
        self.used.append(used.detach())
        return used

    def _forced(self, call: int, own: Tensor) -> Tensor:
        """The forced selection of routed-layer call `call` (0-based), checked against the call's own."""
        if call >= len(self.forced):
            raise ValueError(f"routing replay: routed-layer call {call + 1} has no recorded selection (the record "
                             f"holds {len(self.forced)}): replay the forward that was recorded, on the same inputs")
        forced = self.forced[call]
        if forced.shape != own.shape:
            raise ValueError(f"routing replay: routed-layer call {call + 1} routes {tuple(own.shape)} (tokens, top_k) "
                             f"but the record holds {tuple(forced.shape)}: replay the forward that was recorded, on "
                             "the same inputs")
        return forced.to(own.device)

    @property
    def complete(self) -> bool:
        """Whether every forced selection was used (always, without `forced`)."""
        return self.forced is None or len(self.own) == len(self.forced)


def routed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that route tokens to experts (those with a `routing_tape` attribute), in order."""
    return [module for module in model.modules() if hasattr(module, "routing_tape")]


@contextmanager
def routing_tape(model: nn.Module, tape: RoutingTape) -> Iterator[RoutingTape]:
    """Set `tape` on every routed layer of `model` inside the `with` block (removed on exit, also on error).

    ValueError when `model` routes nothing, when a tape is already set (one record per model at a time), and, for a
    replay, under gradient checkpointing (its recomputation in the backward would route by the model's own router)
    or when the block leaves some of the recorded selections unused."""
    layers = routed_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts layer to record or replay the routing "
                         "of: routing replay is for MoE models (LLaDA2.x)")
    if any(layer.routing_tape is not None for layer in layers):
        raise ValueError(f"{type(model).__name__} already records or replays its routing: one routing tape at a time")
    if tape.forced is not None and any(getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        raise ValueError("routing replay under gradient checkpointing would route the backward's recomputation by "
                         "the model's own router: set gradient_checkpointing=false")
    for layer in layers:
        layer.routing_tape = tape
    try:
        yield tape
    finally:
        for layer in layers:
            layer.routing_tape = None
    if not tape.complete:
        raise ValueError(f"routing replay: {len(tape.forced)} recorded selections, {len(tape.own)} used: replay the "
                         "forward that was recorded, on the same inputs")


def selection_differs(first: Tensor, second: Tensor) -> Tensor:
    """Whether each token's expert set differs between two selections [N, top_k] (order within a set ignored): [N]
    bool."""
    return (first.sort(dim=-1).values != second.sort(dim=-1).values).any(dim=-1)


def forward_input(args: tuple, kwargs: dict) -> Tensor:
    """A model forward's input: its `input_ids` [B, n], else its `inputs_embeds` [B, n, d]."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    return kwargs["inputs_embeds"] if inputs is None else inputs


class AroundEachForward:
    """A context manager calling `_before` and `_after` (a subclass's) around each forward of `model`: the hooks are
    registered on entry and removed on exit, so a forward outside the block is untouched. `_before` opens a routing
    tape's context and keeps it first in a `_pending` tuple, `_after` pops and closes it; on exit, the contexts a
    forward that raised between its hooks left open are closed."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._hooks, self._pending = [], []

    def __enter__(self):
        self._hooks = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                       self.model.register_forward_hook(self._after, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        while self._pending:
            self._pending.pop()[0].__exit__(*exc)


@dataclass(frozen=True)
class ReplayedForward:
    """One trainer forward under `EngineRouting`: its `input_ids` and `position_ids` (None when not passed), and per
    token and routed layer [B, n, layers] bool: `own_differs`, whether the trainer's own router chose another expert
    set than the engine's (split routing's disagreement); `used_differs`, whether the experts the trainer used
    differ from the engine's (0 under replay)."""

    input_ids: Tensor | None
    position_ids: Tensor | None
    own_differs: Tensor
    used_differs: Tensor


class EngineRouting(AroundEachForward):
    """A context manager: while active, each forward of `trainer` is preceded by `engine`'s forward on the same
    inputs (no gradient), whose expert selection the trainer replays (`replay`) or is compared with only.

    `trainer` is the module the likelihood calls (hooks are registered on it on entry and removed on exit); `engine`
    the rollout engine's model (same architecture; the trainer itself in the unified precision flow, where replay
    changes nothing). A forward with a key/value cache is refused: the engine would write the trainer's cache.
    `forwards` lists a `ReplayedForward` per trainer forward."""

    def __init__(self, trainer: nn.Module, engine: nn.Module, replay: bool = True):
        if not routed_layers(trainer):
            raise ValueError(f"experimental.routing_replay: {type(trainer).__name__} has no mixture-of-experts layer "
                             "to replay the routing of: set experimental.routing_replay=false")
        super().__init__(trainer)
        self.trainer, self.engine, self.replay = trainer, engine, replay
        self.forwards: list[ReplayedForward] = []
        self._engine_running = False

    def own_differs_share(self) -> float:
        """The share of (token, routed layer) pairs, over every forward so far (all their tokens), where the trainer's
        own router chose another expert set than the engine's; 0 before any forward."""
        if not self.forwards:
            return 0.0
        return torch.cat([forward.own_differs.flatten() for forward in self.forwards]).float().mean().item()

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._engine_running:  # the engine's own forward, when the engine is the trainer
            return
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ValueError("routing replay replays cache-less forwards (the trajectory estimator without a block "
                             "cache): set experimental.likelihood_decoder=exact or rollout.cache=none")
        engine_tape = RoutingTape()
        self._engine_running = True
        try:
            with torch.no_grad(), routing_tape(self.engine, engine_tape):
                self.engine(*args, **kwargs)
        finally:
            self._engine_running = False
        tape = RoutingTape(engine_tape.used if self.replay else None)
        context = routing_tape(self.trainer, tape)
        context.__enter__()
        self._pending.append((context, engine_tape, tape))

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if self._engine_running:
            return
        context, engine_tape, tape = self._pending.pop()
        context.__exit__(None, None, None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        shape = forward_input(args, kwargs).shape[:2]

        def differs(selections: list[Tensor]) -> Tensor:
            return torch.stack([selection_differs(a, b) for a, b in zip(engine_tape.used, selections)],
                               dim=-1).view(*shape, -1)

        self.forwards.append(ReplayedForward(input_ids, kwargs.get("position_ids"), differs(tape.own),
                                             differs(tape.used)))


def forward_positions(args: tuple, kwargs: dict) -> Tensor:
    """The canvas positions [n] a model forward computes: its `cache_position`, else 0..n−1 of its input."""
    if kwargs.get("cache_position") is not None:
        return kwargs["cache_position"]
    inputs = forward_input(args, kwargs)
    return torch.arange(inputs.shape[1], device=inputs.device)


class PositionedRouting(AroundEachForward):
    """A context manager: each forward of `model` inside it routes through the tape ``tape_for(positions, rows)``
    returns (positions [n]: `forward_positions`; rows: the forward's batch), set on every routed layer for that forward
    only (`routing_tape`: a forced tape must be used up), and ``done(tape, positions, rows)`` is called after it."""

    def __init__(self, model: nn.Module, tape_for: Callable[[Tensor, int], RoutingTape],
                 done: Callable[[RoutingTape, Tensor, int], None] | None = None):
        super().__init__(model)
        self.tape_for, self.done = tape_for, done

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = forward_positions(args, kwargs)
        rows = forward_input(args, kwargs).shape[0]
        tape = self.tape_for(positions, rows)
        context = routing_tape(self.model, tape)
        context.__enter__()
        self._pending.append((context, tape, positions, rows))

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        context, tape, positions, rows = self._pending.pop()
        context.__exit__(None, None, None)
        if self.done is not None:
            self.done(tape, positions, rows)
