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
* ``gather_from_sequence``: all-gather the sequence, in place of ``f``; what its backward does
  depends on who consumed the whole sequence (:class:`GatheredGradient`): tensor-parallel layers,
  whose gradients are partial sums over the ranks' heads (reduce-scatter), layers computed whole,
  whose gradients are equal on every rank (keep this rank's part), or both (see
  :mod:`~lightning_pipe.tensor_parallel.sequence_linear`);
* ``reduce_scatter_to_sequence``: in place of ``g``, the row-parallel partial outputs summed and
  split along the sequence at once; all-gather in backward.

An all-reduce is a reduce-scatter followed by an all-gather, so a block moves the same bytes as
without sequence parallelism while its activations outside the regions are 1/tp of the size.

:class:`CommCounter` counts the collectives issued, so tests can check that a Megatron block does
exactly two all-reduces in forward and two in backward.

A peer lost inside one of these collectives would surface as the transport's bare error ("Connection
closed by peer") from deep inside a layer's forward or an autograd backward. While a runtime runs a
batch it installs its naming (:func:`collectives_named`), and every collective here runs inside it,
saying what it was doing ("all-gathering the sequence over the tensor-parallel group (forward)") and
with which ranks, so that the runtime's fault board turns the loss into its ``PeerLostError`` naming
the rank that stopped. The engine's fault handling stays out of this package: it only gets a
context-manager factory.

Under ``torch.compile`` they run eagerly, with the layers that call them
(:mod:`~lightning_pipe.tensor_parallel.eager`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
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


CollectiveNamer = Callable[[str, Sequence[int]], AbstractContextManager[None]]
"""``namer(what, ranks)``: a context in which a collective with the global ``ranks`` runs, doing
``what``; a lost peer inside it becomes an error naming both (the runtime's ``CollectiveNaming``)."""

_NAMERS: list[CollectiveNamer] = []

_DOING = {
    "all_reduce_forward": "all-reducing the row-parallel outputs over the tensor-parallel group (forward)",
    "all_reduce_backward": "all-reducing the input gradients over the tensor-parallel group (backward)",
    "all_gather_forward": "all-gathering the column-parallel outputs over the tensor-parallel group "
    "(forward)",
    "all_gather_backward": "all-gathering the input gradients over the tensor-parallel group (backward)",
    "sequence_all_gather_forward": "all-gathering the sequence over the tensor-parallel group (forward)",
    "sequence_all_gather_backward": "all-gathering the sequence's gradients over the tensor-parallel "
    "group (backward)",
    "sequence_all_gather_recompute": "all-gathering the sequence again over the tensor-parallel group "
    "(backward)",
    "sequence_reduce_scatter_forward": "reduce-scattering the sequence over the tensor-parallel group "
    "(forward)",
    "sequence_reduce_scatter_backward": "reduce-scattering the sequence's gradients over the "
    "tensor-parallel group (backward)",
}


@contextmanager
def collectives_named(namer: CollectiveNamer) -> Iterator[None]:
    """Inside the block, every tensor-parallel collective (regions, sequence parallelism, the
    vocab-parallel loss) runs inside ``namer(what, ranks)``."""
    _NAMERS.append(namer)
    try:
        yield
    finally:
        _NAMERS.remove(namer)


def named(what: str, group: dist.ProcessGroup) -> AbstractContextManager[None]:
    """The installed namer's context for a collective over ``group`` doing ``what`` (or ``kind``,
    a :func:`count_collectives` key), or nothing when none is installed (a layer used on its own)."""
    if not _NAMERS:
        return nullcontext()
    return _NAMERS[-1](_DOING.get(what, what), dist.get_process_group_ranks(group))


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    _note(kind)
    out = x.contiguous().clone()
    with named(kind, group):
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
    with named(kind, group):
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


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """The ranks' parts of the sequence, whole (no autograd; counted as ``kind``)."""
    return start_all_gather_sequence(x, group, kind)()


def start_all_gather_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, kind: str
) -> Callable[[], torch.Tensor]:
    """Start :func:`all_gather_sequence` without waiting; the returned call waits and gives the
    whole sequence (so that computation can run while it travels)."""
    size = dist.get_world_size(group)
    if size == 1:
        return lambda: x
    _note(kind)
    # The ranks' parts, one after the other (dim 0 of the flat buffer), then the sequence put back
    # in dim 1: one copy, none when the batch is 1.
    flat = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with named(kind, group):
        pending: list[Any] = [all_gather_flat(flat, x.contiguous(), group=group, async_op=True), flat]
    done: list[torch.Tensor] = []
    shape = x.shape

    def wait() -> torch.Tensor:  # the same tensor however often it is asked for
        if not done:
            work, buffer = pending
            with named(kind, group):
                work.wait()
            parts = buffer.view(size, *shape)
            done.append(parts.movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1))
            # The flat buffer (and the work that holds it) is let go: with a batch above 1 the
            # sequence-major result is a copy, and two whole sequences would stay alive.
            pending.clear()
        return done[0]

    return wait


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """This rank's part of the sequence of ``x`` summed over the ranks (no autograd; counted as
    ``kind``)."""
    return start_reduce_scatter_sequence(x, group, kind)()


def start_reduce_scatter_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, kind: str
) -> Callable[[], torch.Tensor]:
    """Start :func:`reduce_scatter_sequence` without waiting; the returned call waits and gives
    this rank's summed part."""
    size = dist.get_world_size(group)
    if size == 1:
        return lambda: x
    _note(kind)
    part = _sequence_part(x.shape[SEQUENCE_DIM], size)
    shape = (*x.shape[:SEQUENCE_DIM], size, part, *x.shape[SEQUENCE_DIM + 1 :])
    # Each rank's part of the sequence first (dim 0), so that rank r receives part r, summed.
    parts = x.reshape(shape).movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    # The parts one after the other.
    with named(kind, group):
        work = reduce_scatter_flat(out, parts.flatten(0, 1), group=group, async_op=True)

    def wait() -> torch.Tensor:
        with named(kind, group):
            work.wait()
        return out

    return wait


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_sequence(grad, ctx.group, "sequence_all_gather_backward"), None


class GatheredGradient(Enum):
    """What the consumers of an all-gathered sequence send back, which decides how the gather's
    backward turns their gradient into this rank's part's (Megatron's ``tensor_parallel_output_grad``
    is the first two)."""

    PARTIAL = "partial"
    """Tensor-parallel layers only: each rank's gradient is its heads' partial sum; reduce-scatter."""
    EQUAL = "equal"
    """Layers computed whole only (a head): the gradient is equal on every rank; keep this rank's
    part, no communication."""
    MIXED = "mixed"
    """Both: column-parallel layers send ``size`` times their partial gradient, layers computed
    whole their equal one; the sum over the ranks, divided by ``size``, is the whole gradient
    (a reduce-scatter, where ``f`` before each column layer would all-reduce)."""


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, gradient: GatheredGradient
    ) -> torch.Tensor:
        ctx.group, ctx.gradient = group, gradient
        return all_gather_sequence(x, group, "sequence_all_gather_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.gradient is GatheredGradient.EQUAL:
            return _split_sequence(grad, ctx.group), None, None
        part = reduce_scatter_sequence(grad, ctx.group, "sequence_reduce_scatter_backward")
        if ctx.gradient is GatheredGradient.MIXED:
            part = part / dist.get_world_size(ctx.group)
        return part, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_sequence(x, group, "sequence_reduce_scatter_forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_sequence(grad, ctx.group, "sequence_all_gather_backward"), None


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this rank's part of the sequence forward; all-gather the gradient backward."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence(
    x: torch.Tensor, group: dist.ProcessGroup, gradient: GatheredGradient = GatheredGradient.PARTIAL
) -> torch.Tensor:
    """All-gather the sequence forward; backward, this rank's part of the whole gradient, from what
    the consumers send back (``gradient``)."""
    return _GatherFromSequence.apply(x, group, gradient)


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group and keep this rank's part of the sequence forward; all-gather the
    gradient backward."""
    return _ReduceScatterToSequence.apply(x, group)
