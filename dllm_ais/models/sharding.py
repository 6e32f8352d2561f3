"""A model sharded across processes by FSDP2 (``fully_shard``): whether one is, and values its processes agree on.

Each forward of a sharded model gathers its weights on every process at once (and its backward again), so every
process must run the same forwards: a host read that decides how many run is first made the same on every process
(`agreed_across_processes`). The samplers (`dllm_ais.sampling.forwards.EagerForwards.agreed`) and the likelihood
replays (`dllm_ais.likelihood.trajectory`) do so.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["agreed_across_processes", "is_sharded"]


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` (or a module inside it: the trainer's wrappers put the sharded root anywhere) is sharded by
    FSDP2 (``fully_shard``) in a torch.distributed run of more than one process: each of its forwards then gathers
    weights on every process at once."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule) or any(isinstance(module, FSDPModule) for module in model.modules())


def agreed_across_processes(values: torch.Tensor, op: str | Sequence[str] = "max",
                            group: Any = None) -> torch.Tensor:
    """`values` (integers or bools, on the device the process group communicates on) made the same on every process
    of `group` (None: the default group) by one all-reduce: each element its maximum over the processes (`op`
    "max": a count) or its minimum ("min": over bools, their AND); `op` one name for every element or one per element
    of a 1-D `values`. Returns a tensor of `values`' shape and dtype."""
    import torch.distributed as dist
    ops = [op] * values.numel() if isinstance(op, str) else list(op)
    if len(ops) != values.numel() or set(ops) - {"max", "min"}:
        raise ValueError(f"agreed_across_processes takes op 'max' or 'min', one or one per value; got {op!r} for "
                         f"{values.numel()} values")
    signs = torch.tensor([1 if name == "max" else -1 for name in ops], dtype=torch.long, device=values.device)
    work = values.reshape(-1).long() * signs  # a minimum is the negated maximum of the negated values: one all-reduce
    dist.all_reduce(work, op=dist.ReduceOp.MAX, group=group)
    return (work * signs).reshape(values.shape).to(values.dtype)
