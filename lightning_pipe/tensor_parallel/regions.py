"""The four autograd boundaries of a tensor-parallel region (Megatron-LM's ``f``, ``g``, gather,
scatter), each taking its process group explicitly.

* ``copy_to_region`` (the paper's ``f``): identity forward, all-reduce backward. Where a
  replicated activation enters column-parallel layers, each rank's backward holds only its
  shard's contribution to the input gradient; their sum is the full gradient.
* ``reduce_from_region`` (``g``): all-reduce forward, identity backward. Where row-parallel
  partial outputs leave the region, their sum is the output.
* ``gather_from_region`` / ``scatter_to_region``: concatenate or split along the last dim, with
  the opposite operation in backward.

Under sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models") activations between regions are split along the sequence, dim 1 of
``[batch, sequence, hidden]`` (Megatron keeps ``[sequence, batch, hidden]`` and splits dim 0):

* ``scatter_to_sequence``: keep this rank's part of the sequence; all-gather in backward (where
  the sequence-parallel region begins, after an embedding computed whole);
* ``gather_from_sequence``: all-gather the sequence, in place of ``f``; backward reduce-scatters
  the gradient when the consumers are tensor-parallel (each rank's gradient is a partial sum over
  its heads), or keeps this rank's part when they computed whole (equal on every rank);
* ``reduce_scatter_to_sequence``: in place of ``g``, the row-parallel partial outputs summed and
  split along the sequence at once; all-gather in backward.

An all-reduce is a reduce-scatter followed by an all-gather, so a block moves the same bytes as
without sequence parallelism while its activations outside the regions are 1/tp of the size.

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

from lightning_pipe.collectives import all_gather_flat, reduce_scatter_flat

SEQUENCE_DIM = 1
"""The sequence dim of the activations sequence parallelism splits (``[batch, sequence, ...]``)."""

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


# ------------------------------------------------------------------------- sequence parallelism
_SUSPENDED: list[bool] = []


@contextmanager
def sequence_parallel_suspended() -> Iterator[None]:
    """Inside the block, sequence-parallel layers and hooks compute as without sequence parallelism
    (whole sequences, all-reduces): the checks that run a stage's layers on a whole probe use it."""
    _SUSPENDED.append(True)
    try:
        yield
    finally:
        _SUSPENDED.pop()


def sequence_active() -> bool:
    """Whether sequence parallelism applies now (it is not suspended)."""
    return not _SUSPENDED


def _sequence_part(length: int, size: int) -> int:
    if length % size != 0:
        raise ValueError(
            f"Sequence parallelism splits the sequence (dim {SEQUENCE_DIM}, length {length}) over "
            f"{size} tensor ranks, which does not divide it; pad sequences to a multiple of {size}."
        )
    return length // size


def _split_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    part = _sequence_part(x.shape[SEQUENCE_DIM], size)
    # A copy: a view would keep the whole tensor alive (and be counted as the part's bytes).
    mine = x.narrow(SEQUENCE_DIM, dist.get_rank(group) * part, part)
    return mine.clone(memory_format=torch.contiguous_format)


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    _note(kind)
    # The ranks' parts, one after the other (dim 0 of the flat buffer), then the sequence put back
    # in dim 1: one copy, none when the batch is 1.
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(flat, x.contiguous(), group=group)
    parts = flat.view(size, *x.shape)
    return parts.movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    _note(kind)
    part = _sequence_part(x.shape[SEQUENCE_DIM], size)
    shape = (*x.shape[:SEQUENCE_DIM], size, part, *x.shape[SEQUENCE_DIM + 1 :])
    # Each rank's part of the sequence first (dim 0), so that rank r receives part r, summed.
    parts = x.reshape(shape).movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, parts.flatten(0, 1), group=group)  # the parts one after the other
    return out


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group, "sequence_all_gather_backward"), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, partial_grad: bool) -> torch.Tensor:
        ctx.group, ctx.partial_grad = group, partial_grad
        return _gather_sequence(x, group, "sequence_all_gather_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.partial_grad:
            return _reduce_scatter_sequence(grad, ctx.group, "sequence_reduce_scatter_backward"), None, None
        return _split_sequence(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group, "sequence_reduce_scatter_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_sequence(grad, ctx.group, "sequence_all_gather_backward"), None


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's part of the sequence forward; all-gather the gradient backward."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, partial_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence forward; backward, reduce-scatter the gradient (``partial_grad``:
    tensor-parallel consumers) or keep this rank's part (consumers computed whole)."""
    return _GatherFromSequence.apply(x, group, partial_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group and keep this rank's part of the sequence forward; all-gather the
    gradient backward."""
    return _ReduceScatterToSequence.apply(x, group)
