"""The four autograd boundaries of a tensor-parallel region (Megatron-LM's ``f``, ``g``, gather,
scatter), each taking its process group explicitly.

* ``copy_to_region`` (the paper's ``f``): identity forward, all-reduce backward. Where a
  replicated activation enters column-parallel layers, each rank's backward holds only its
  shard's contribution to the input gradient; their sum is the full gradient.
* ``reduce_from_region`` (``g``): all-reduce forward, identity backward. Where row-parallel
  partial outputs leave the region, their sum is the output.
* ``gather_from_region`` / ``scatter_to_region``: concatenate or split along the last dim, with
  the opposite operation in backward.

:class:`CommCounter` counts the collectives issued, so tests can check that a Megatron block does
exactly two all-reduces in forward and two in backward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

_COUNTERS: list[Counter[str]] = []


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the region collectives issued inside the block, by ``"<kind>_<direction>"``."""
    counter: Counter[str] = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _note(kind: str) -> None:
    for counter in _COUNTERS:
        counter[kind] += 1


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    _note(kind)
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    _note(kind)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, "all_reduce_backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group, "all_reduce_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group, "all_gather_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group, "all_gather_backward"), None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient in backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return _ScatterToRegion.apply(x, group)
