"""Bucketed gradient all-reduce over the data-parallel group that overlaps the last backward.

The design follows PyTorch DDP's reducer (Li et al., 2020, arXiv:2006.15704), cut to what a
pipeline needs:

* Parameters are grouped into buckets of about ``bucket_cap_mb`` in *reverse* registration order
  (the last layers' gradients are ready first in backward), each bucket a flat buffer whose slices
  are the parameters' ``.grad`` (no copy before or after the collective).
* A pipeline step runs many backwards (one per micro-batch, and accumulated batches on top); only
  the last backward of the last accumulated batch is *armed*. Before that, gradients accumulate
  locally and no collective is issued.
* While armed, a post-accumulate-grad hook counts each bucket's ready parameters; a full bucket's
  all-reduce is launched asynchronously at once, so communication overlaps the rest of backward.
  Launches follow bucket order on every rank whatever order gradients become ready in (a bucket
  that fills early waits for its predecessors), because collectives must match across ranks.
* With ``shard=True`` (ZeRO-1, :mod:`.sharded_optimizer`) each bucket is reduce-scattered instead
  (in place, on NCCL; gloo all-reduces it, its reduce-scatter being slower than its all-reduce):
  rank ``k`` of ``n`` needs only the average of the ``k``-th of ``n`` equal slices of every
  bucket (:attr:`GradientReducer.shards`, views into the buffers), which is all its optimizer
  steps; the buffers are padded to a multiple of ``n``. Parameters listed as ``late`` (copies
  tied across pipeline stages) sit in the last buckets, which launch only in
  :meth:`~GradientReducer.finish`, after its ``before_late`` callback has summed the copies
  (their slices differ between stages, so they must be summed whole, before the scatter).
* :meth:`GradientReducer.finish` launches what never filled (parameters without a gradient in the
  last backward take part with what they hold, zeros for unused ones, so no rank waits), waits
  for everything, and resets to ``None`` the gradients of parameters that no replica used in the
  whole window, as on one device. Which parameters were used travels as one flag per parameter
  in spare slots at the end of the last bucket, so this costs no extra collective (unless the
  buckets are reduce-scattered, ZeRO-1 on NCCL: then the flags are all-reduced on their own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.collectives import reduce_scatter_flat


@dataclass(frozen=True)
class BucketView:
    """One gradient bucket as a ZeRO-1 optimizer sees it."""

    params: tuple[tuple[nn.Parameter, int], ...]
    """Its parameters and where each starts in the bucket."""
    buffer: torch.Tensor
    """The flat gradient buffer (the parameters' ``.grad`` are views into it)."""
    shard: torch.Tensor
    """This replica's slice of the buffer (a view): the averaged gradient after ``finish``."""
    shard_range: range
    """The elements of the buffer the shard covers."""
    group: dist.ProcessGroup | None = None
    """The group this bucket is reduced and gathered over; ``None``: its layout's."""
    size: int | None = None
    """Replicas in :attr:`group`; ``None``: its layout's."""


@dataclass(frozen=True)
class BucketLayout:
    """The buckets of a sharding :class:`GradientReducer`, fixed once it is built: what
    :class:`~.sharded_optimizer.ShardedOptimizer` steps and gathers. Several reducers' layouts
    joined (:meth:`join`) keep each bucket's own group: under expert parallelism the experts'
    buckets are sharded over the ranks holding the same experts, the rest over the data axis."""

    buckets: tuple[BucketView, ...]
    group: dist.ProcessGroup
    """The data-parallel group the buckets are reduced and gathered over (unless a bucket names
    its own)."""
    size: int
    """Replicas in the group."""

    def group_of(self, k: int) -> dist.ProcessGroup:
        """The group bucket ``k`` is reduced and gathered over."""
        group = self.buckets[k].group
        return self.group if group is None else group

    def size_of(self, k: int) -> int:
        """Replicas in bucket ``k``'s group."""
        size = self.buckets[k].size
        return self.size if size is None else size

    def join(self, other: BucketLayout) -> BucketLayout:
        """This layout's buckets, then ``other``'s, each keeping its own group."""
        own = tuple(
            replace(b, group=self.group_of(k), size=self.size_of(k)) for k, b in enumerate(self.buckets)
        )
        theirs = tuple(
            replace(b, group=other.group_of(k), size=other.size_of(k)) for k, b in enumerate(other.buckets)
        )
        return BucketLayout(own + theirs, self.group, self.size)


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    offsets: list[int]
    """Where each parameter starts in ``buffer``."""
    late: bool = False
    pending: int = 0
    work: dist.Work | None = None
    launched: bool = False
    divided: list[bool] = field(default_factory=list)
    """Per parameter: its slice already holds its gradient divided by the group size (moved in,
    divided on the way, by the window's last backward)."""


@dataclass
class GradientReducer:
    """Averages the gradients of ``params`` over ``group``; see the module docstring."""

    params: Sequence[nn.Parameter]
    group: dist.ProcessGroup
    bucket_cap_mb: float = 25.0
    shard: bool = False
    late: Sequence[nn.Parameter] = ()
    divisor: int | None = None
    """What the summed gradients are divided by (default: the group's size). Expert parameters are
    summed over the ranks holding the same experts but divided by the whole data axis's size: each
    rank's gradient of them already sums its expert group's tokens (the all-to-all's backward)."""
    shards: list[torch.Tensor] = field(default_factory=list, init=False)
    """With ``shard``: this rank's averaged slice of each bucket (after :meth:`finish`)."""
    used: dict[int, bool] = field(default_factory=dict, init=False)
    """After :meth:`finish`: by ``id()``, whether any replica's backward reached the parameter."""
    _buckets: list[_Bucket] = field(default_factory=list, init=False)
    _where: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)
    _armed: bool = field(default=False, init=False)
    _next: int = field(default=0, init=False)
    _used: torch.Tensor = field(default_factory=lambda: torch.zeros(0), init=False)
    _flags: torch.Tensor | None = field(default=None, init=False)
    """The used flags' slots in the last bucket (``None``: they travel on their own)."""
    _used_here: list[bool] = field(default_factory=list, init=False)
    """The used flags as the host saw the hooks run: when this rank used every parameter, so did
    the replicas together, and the reduced flags need no read (on CUDA a read waits for the device)."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}.")
        unique = list({id(p): p for p in self.params if p.requires_grad}.values())
        late_ids = {id(p) for p in self.late} if self.shard else set()
        early = [p for p in unique if id(p) not in late_ids]
        late_params = [p for p in unique if id(p) in late_ids]
        # Late parameters last: they launch after every other bucket (and are registered last).
        unique = early + late_params
        self.params = unique
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._divide_by = self.size if self.divisor is None else self.divisor
        self._scatter = dist.get_backend(self.group) == "nccl"
        cap = int(self.bucket_cap_mb * 1024 * 1024)
        for group_params, late in ((early, False), (late_params, True)):
            current: list[nn.Parameter] = []
            for param in reversed(group_params):
                full = sum(p.numel() * p.element_size() for p in current)
                same_kind = not current or (
                    current[0].dtype == param.dtype and current[0].device == param.device
                )
                if current and (full + param.numel() * param.element_size() > cap or not same_kind):
                    self._add_bucket(current, late=late)
                    current = []
                current.append(param)
            if current:
                # The used flags ride in spare slots of the last bucket, unless it is scattered
                # (each rank would receive a slice of them).
                last = (late or not late_params) and not (self.shard and self._scatter)
                self._add_bucket(current, flags=len(unique) if last else 0, late=late)
        device = unique[0].device if unique else torch.device("cpu")
        self._used = torch.zeros(len(unique), dtype=torch.uint8, device=device)
        self._used_here = [False] * len(unique)
        for position, param in enumerate(unique):
            param.register_post_accumulate_grad_hook(self._hook(position))

    def _add_bucket(self, params: list[nn.Parameter], flags: int = 0, late: bool = False) -> None:
        first = params[0]
        numel = sum(p.numel() for p in params) + flags
        if self.shard:  # equal slices for reduce_scatter
            numel = -(-numel // self.size) * self.size
        buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        views, offsets, offset = [], [], 0
        index = len(self._buckets)
        for slot, param in enumerate(params):
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offsets.append(offset)
            self._where[id(param)] = (index, slot)
            offset += param.numel()
        if flags:
            self._flags = buffer[offset : offset + flags]
        self._buckets.append(_Bucket(index, params, buffer, views, offsets, late))
        if self.shard:  # this rank's slice: a view, so reductions and gathers work in place
            width = numel // self.size
            self.shards.append(buffer[self.rank * width : (self.rank + 1) * width])

    def layout(self) -> BucketLayout:
        """The buckets as a ZeRO-1 optimizer sees them (with ``shard``: fixed once built)."""
        if not self.shard:
            raise ValueError("A bucket layout with shards needs a GradientReducer built with shard=True.")
        buckets = tuple(
            BucketView(
                tuple(zip(b.params, b.offsets, strict=True)),
                b.buffer,
                self.shards[b.index],
                range(
                    self.rank * self.shards[b.index].numel(), (self.rank + 1) * self.shards[b.index].numel()
                ),
            )
            for b in self._buckets
        )
        return BucketLayout(buckets, self.group, self.size)

    @property
    def bucket_sizes(self) -> list[int]:
        """Parameters per bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

    def attach(self) -> None:
        """Start an accumulation window. Call it right after the optimizer's ``zero_grad``.

        A gradient that ``zero_grad`` set to ``None`` stays ``None``: autograd then hands the first
        backward's gradient over without adding it to anything, and the hook moves it into its
        slice (divided by the group size on the way when that backward is the window's last,
        DDP's ``gradient_as_bucket_view``). Zeroing every slice here and letting autograd add into
        it would cost a pass over all gradients to write zeros and another to read them back. A
        gradient that is not ``None`` (``zero_grad(set_to_none=False)``, or one set by hand) is
        kept: moved into its slice.
        """
        for bucket in self._buckets:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                grad = param.grad
                if grad is not None and grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    param.grad = view
            bucket.divided = [False] * len(bucket.params)
        self._used.zero_()
        self._used_here = [False] * len(self._used_here)

    def arm(self) -> None:
        """The next backward is the window's last: launch each bucket as soon as it is full."""
        self._armed = True
        self._next = 0
        for bucket in self._buckets:
            bucket.pending, bucket.work, bucket.launched = len(bucket.params), None, False

    def _hook(self, position: int):
        def on_grad_ready(param: nn.Parameter) -> None:
            self._used[position] = 1
            self._used_here[position] = True
            index, slot = self._where[id(param)]
            bucket = self._buckets[index]
            view, grad = bucket.views[slot], param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                # Autograd handed a new gradient over (it was None): move it into the bucket, divided
                # on the way if nothing will be added to it before the all-reduce (one pass).
                if self._armed and not bucket.late and not bucket.launched:
                    torch.mul(grad, 1.0 / self._divide_by, out=view)
                    bucket.divided[slot] = True
                else:
                    view.copy_(grad)
                param.grad = view
            if not self._armed or bucket.late:
                return
            bucket.pending -= 1
            self._launch_ready()

        return on_grad_ready

    def _launch(self, bucket: _Bucket) -> None:
        for param, view in zip(bucket.params, bucket.views, strict=True):
            grad = param.grad
            if grad is None:  # no gradient on this rank in this window: its slice holds old data
                view.zero_()
                param.grad = view
            elif grad.data_ptr() != view.data_ptr():  # set after the backward (a tied copy's sum)
                view.copy_(grad)
                param.grad = view
        if bucket.index == len(self._buckets) - 1 and self._flags is not None:
            # Launched last, once every earlier bucket is complete: the used flags are final.
            self._flags.copy_(self._used)
        # Average = sum of pre-divided parts (DDP's order); slices divided on their way in are not
        # divided again (the used flags need no division: they are only compared with 0).
        if not any(bucket.divided):
            bucket.buffer.div_(self._divide_by)
        elif not all(bucket.divided):
            for view, divided in zip(bucket.views, bucket.divided, strict=True):
                if not divided:
                    view.div_(self._divide_by)
        if self.shard and self._scatter:
            bucket.work = reduce_scatter_flat(
                self.shards[bucket.index],
                bucket.buffer,
                op=dist.ReduceOp.SUM,
                group=self.group,
                async_op=True,
            )
        else:  # gloo's reduce-scatter is slower than its all-reduce (26 vs 18 ms, 24 MiB)
            bucket.work = dist.all_reduce(
                bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        bucket.launched = True

    def _launch_ready(self) -> None:
        while (
            self._next < len(self._buckets)
            and self._buckets[self._next].pending == 0
            and not self._buckets[self._next].late
        ):
            self._launch(self._buckets[self._next])
            self._next += 1

    def finish(self, before_late: Callable[[], None] | None = None) -> None:
        """Launch what is left, in order, wait for all, and drop globally unused gradients
        (``before_late``: called before the ``late`` buckets launch, with ``shard``)."""
        if not self._armed:
            self.arm()
        for bucket in self._buckets[self._next :]:
            if bucket.late and before_late is not None:
                before_late()
                before_late = None
            self._launch(bucket)
        if before_late is not None:
            before_late()
        self._next = len(self._buckets)
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._armed = False
        if not self.params:
            return
        if self._flags is None:  # reduce-scattered buckets: the flags travel on their own
            flags = self._used.to(torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        else:
            flags = self._flags
        if all(self._used_here):  # used here, so used by some replica: nothing to read
            used = [True] * len(self.params)
        else:
            used = (flags > 0).tolist()  # some replica used it
        self.used = dict(zip((id(p) for p in self.params), used, strict=True))
        for position, param in enumerate(self.params):
            if not used[position]:
                param.grad = None
