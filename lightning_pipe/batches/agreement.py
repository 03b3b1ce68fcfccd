"""Check, before each step, that every rank of a model replica is about to run the same batch.

Every rank of one pipeline (and of one tensor group) loads the batch itself: stage 0 feeds its
inputs to the layers, the last stage computes the loss against its labels. If their data differ
(an ``IterableDataset`` that shards by *global* rank, an unseeded per-process shuffle), stage 0
would train on one batch while the loss uses another batch's labels, and nothing would fail. So
before a step each rank computes a *fingerprint* of its batch (which step and batch index it is
at, a checksum of the shapes and dtypes, and two weighted sums of the values) and the replica
agrees on it with all-reduces of a few numbers (maximum of ``[f, -f]``: the ranks agree exactly
when the maximum equals the minimum). What the host knows (the step, the shapes) is agreed before
the schedule, over a group that takes host tensors, because a difference in shapes would otherwise
break the pipeline's header protocol (see :mod:`.p2p`) before any check could run. The values are
on the device: their all-reduce is queued before the schedule and its verdict read once the step's
work is queued (on CUDA a read makes the host wait for the device), before any optimizer step.

The host all-reduce carries a flag for a problem one rank found on its own before the step (see
:mod:`.forward_contract`), so that every rank stops with the same message instead of waiting on
the rank that stopped. Only when something is wrong are the details gathered, to name the ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.batches.microbatch import signature, tensors_of


@dataclass(frozen=True)
class StepIdentity:
    """Which step a rank is about to run: its kind (``"training_step"``, ...) and batch index."""

    step_name: str
    batch_idx: int

    def __str__(self) -> str:
        return f"{self.step_name} of batch {self.batch_idx}" if self.batch_idx >= 0 else self.step_name


@dataclass(frozen=True)
class Fingerprint:
    """What a rank holds at a step: ``host`` (float64, on the host: the step's code, its batch
    index, a checksum of the batch's shapes and dtypes, a problem flag), known without reading the
    device; ``values`` (float64, on the device: two weighted sums of the batch's values)."""

    host: torch.Tensor
    values: torch.Tensor


def fingerprint(batch: Any, step: StepIdentity, device: torch.device) -> Fingerprint:
    """A fingerprint that differs, with overwhelming probability, between different batches.

    Row weights make a reordering of the samples visible, column weights a reordering inside a
    sample (the same tokens in another order); NaNs count as zeros so that a batch equals itself.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    weighted = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors_of(batch):
        t = tensor.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        rows = t.reshape(t.shape[0] if t.dim() else 1, -1).to(device=device, dtype=torch.float64)
        rows = rows.nan_to_num(nan=0.0, posinf=1e300, neginf=-1e300)
        cols = 1.0 + torch.arange(rows.shape[1], dtype=torch.float64, device=device).remainder(13) / 13
        row_weights = 1.0 + torch.arange(rows.shape[0], dtype=torch.float64, device=device)
        per_row = (rows * cols).sum(1)
        total += rows.sum()
        weighted += (per_row * row_weights).sum()
    shapes = zlib.crc32(repr(signature(batch)).encode())
    host = torch.tensor(
        # Every step kind and loop end its own code: "end of validation" must differ from
        # "end of test" as much as from a training step.
        [zlib.crc32(step.step_name.encode()), step.batch_idx, shapes, 0.0],
        dtype=torch.float64,
    )
    return Fingerprint(host, torch.stack([total, weighted]))


SAME_DATA_FIX = (
    "Every rank of a pipeline and of a tensor group must load the same batch; only data-parallel "
    "replicas load different data. Shard the data by the data-parallel rank and size "
    "(trainer.strategy.data_parallel_rank and .data_parallel_world_size, what Lightning's "
    "DistributedSampler uses under pipe_tp), never by the global rank, and seed any shuffling, and "
    "any data the script makes at random, the same on every rank: every process runs the script "
    "(seed_everything before building the data, or a seeded generator)."
)


class StepCheckError(RuntimeError):
    """The ranks of one model replica cannot run a step together: they hold different batches or
    are at different steps, or one of them found a problem with the model before the step."""


class EarlyCopy:
    """A small device tensor copied to the host as soon as it is computed, read later.

    On CUDA the copy is queued (``non_blocking`` into pinned memory) with an event after it:
    :meth:`value` waits for that event only, i.e. for the work queued *before* the copy, not for
    what the step queued since (a plain read would wait for the whole queue). On the CPU it is a
    plain copy.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        pinned = tensor.device.type == "cuda"
        self.host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=pinned)
        self.host.copy_(tensor.detach(), non_blocking=True)  # on the CPU, a plain copy
        self.event = None
        if pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def value(self) -> torch.Tensor:
        """The tensor, on the host (waiting for the copy, on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class PendingAgreement:
    """The values' half of an agreement, all-reduced on the device and its verdict copied to
    the host early (:class:`EarlyCopy`): :meth:`confirm` reads it once the step's work is queued."""

    verdict: EarlyCopy
    """Whether every rank of the replica holds the same values."""
    local: Fingerprint
    host_group: dist.ProcessGroup
    describe: Callable[[int], str]
    step: StepIdentity
    batch: Any

    def confirm(self) -> None:
        """Raise the same :class:`StepCheckError` on every rank of the replica if their batches'
        values differ."""
        if not bool(self.verdict.value()):
            _disagree(self.local, self.host_group, self.describe, self.step, self.batch, None)


def agree(
    local: Fingerprint,
    group: dist.ProcessGroup,
    host_group: dist.ProcessGroup,
    describe: Callable[[int], str],
    step: StepIdentity,
    batch: Any,
    problem: str | None = None,
    defer: bool = False,
) -> PendingAgreement | None:
    """Raise the same error on every rank of ``group`` unless all ranks hold the same ``local``
    fingerprint and none reports a ``problem``.

    The host half (step, shapes, problem) is agreed at once over ``host_group`` (``group``'s ranks,
    taking host tensors), so that no rank starts a schedule its peers would run with other
    shapes; the values' half is all-reduced over ``group`` on the device, and with ``defer``
    returned unread (:meth:`PendingAgreement.confirm` reads it), so that the host does not wait
    for the device before the step's work is queued.

    Args:
        describe: global rank -> a short description of that rank (its coordinates).
        problem: a message this rank found on its own before the step; every rank raises it.
    """
    host = local.host.clone()
    if problem is not None:
        host[-1] = 1.0
    values = torch.cat([local.values, -local.values])
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    both = torch.cat([host, -host])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=host_group)
    n = host.numel()
    if not torch.equal(both[:n], -both[n:]) or float(both[n - 1]) != 0.0:
        _disagree(Fingerprint(host, local.values), host_group, describe, step, batch, problem)
    k = local.values.numel()
    same = EarlyCopy((values[:k] == -values[k:]).all())  # queued right behind the all-reduce
    pending = PendingAgreement(same, local, host_group, describe, step, batch)
    if defer:
        return pending
    pending.confirm()
    return None


def _disagree(
    local: Fingerprint,
    host_group: dist.ProcessGroup,
    describe: Callable[[int], str],
    step: StepIdentity,
    batch: Any,
    problem: str | None,
) -> None:
    """Something differs: gather who holds what (rare, so an object gather is fine here), raise."""
    numbers = local.host.tolist()[:3] + local.values.tolist()  # the values: a read, on failure only
    mine = (dist.get_rank(), numbers, repr(signature(batch)), str(step), problem)
    everyone: list[Any] = [None] * dist.get_world_size(host_group)
    dist.all_gather_object(everyone, mine, group=host_group)
    problems = [(rank, text) for rank, _, _, _, text in everyone if text is not None]
    if problems:
        rank, text = problems[0]
        raise StepCheckError(f"Rank {rank} ({describe(rank)}) stopped before the step: {text}")
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, values, shapes, at, _ in everyone:
        groups.setdefault((tuple(values), shapes, at), []).append(rank)
    lines = [
        f"  ranks {ranks} ({', '.join(describe(r) for r in ranks)}): {at}, shapes {shapes}, "
        f"checksums {values[3]:.10g} / {values[4]:.10g}"
        for (values, shapes, at), ranks in groups.items()
    ]
    steps = {at for _, _, at in groups}
    if len(steps) > 1:
        cause = (
            "The ranks are at different steps: their dataloaders have different lengths (or one "
            "of them ran out of data)."
        )
    else:
        cause = "The ranks loaded different data for the same step."
    raise StepCheckError(
        f"pipe_tp: the ranks of one model replica must run the same batch, but at {step} they do not. "
        f"{cause}\n" + "\n".join(lines) + "\n" + SAME_DATA_FIX
    )
