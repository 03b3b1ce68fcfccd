"""What a :class:`~lightning_pipe.runtime.ParallelRuntime` is asked to do, in one dataclass.

The Lightning strategy fills it from its constructor arguments; a plain-torch training loop builds
it directly. Nothing here depends on the processes: it is checked when it is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from lightning_pipe.arguments import check_count, check_flag, check_positive
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.partition.balance import PartitionMethod, check_partition
from lightning_pipe.schedule.builders import ScheduleKind


class ConfigurationError(ValueError):
    """A model, plan or option the runtime cannot train as asked, with what to do instead."""


@dataclass(frozen=True)
class RuntimeOptions:
    """How to split, schedule and synchronise one model."""

    num_microbatches: int | None = None
    """Micro-batches per batch; ``None``: ``2 x pipeline_parallel_size``, capped at the batch size."""
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B
    """``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zb_h1"``."""
    partition: PartitionMethod | str | Sequence[int] = "parameters"
    """``"parameters"``, ``"uniform"``, ``"time"`` (measured on a sample micro-batch at setup) or
    layer counts per stage."""
    virtual_stages: int = 1
    """Stages per pipeline rank (``schedule="interleaved_1f1b"``; loop placement: rank ``r`` holds
    stages ``r, r + p, ...``)."""
    recompute: RecomputeMode | str = RecomputeMode.NEVER
    """Activation recomputation: ``"never"``, ``"except_last"`` or ``"always"``."""
    tensor_parallel_plan: Mapping[str, str] | None = None
    """Module-name pattern -> style; needed when the tensor axis has more than one rank."""
    shard_optimizer_state: bool = False
    """ZeRO-1: each data-parallel replica keeps the optimizer state of 1/dp of its stage
    (:mod:`lightning_pipe.data_parallel.sharded_optimizer`)."""
    bucket_cap_mb: float = 25.0
    """Size of the data-parallel reducer's gradient buckets."""
    timeout: timedelta | None = None
    """Deadline of every pipeline exchange (``None``: the process group's)."""
    check_finite: bool = False
    """Raise at the first stage output or loss holding NaN/Inf, naming where."""
    deferred_batch_norm: bool = True
    """BatchNorm running statistics from the whole batch (torchgpipe's deferred batch norm)."""
    check_forward: bool = True
    """On the first batch, check that the module's ``forward`` is its pipeline layers chained."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", ScheduleKind.parse(self.schedule))
        object.__setattr__(self, "recompute", RecomputeMode.parse(self.recompute))
        if self.num_microbatches is not None:
            check_count("num_microbatches", self.num_microbatches, also="None (2 x pipeline_parallel_size)")
        check_partition(self.partition)
        v = self.virtual_stages
        check_count("virtual_stages", v)
        if v > 1 and self.schedule_kind is not ScheduleKind.INTERLEAVED_1F1B:
            raise ValueError(
                f"virtual_stages={v} (several stages per pipeline rank) needs "
                f"schedule='interleaved_1f1b', the only schedule with several; got "
                f"schedule={self.schedule_kind.value!r}."
            )
        check_positive("bucket_cap_mb", self.bucket_cap_mb, "megabytes per gradient bucket")
        for name in ("shard_optimizer_state", "check_finite", "deferred_batch_norm", "check_forward"):
            check_flag(name, getattr(self, name))
        if self.timeout is not None and (
            not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0
        ):
            raise ValueError(f"timeout must be a positive datetime.timedelta or None, got {self.timeout!r}.")

    @property
    def schedule_kind(self) -> ScheduleKind:
        """``schedule`` as the enum (``__post_init__`` stored it so; typed for readers)."""
        return ScheduleKind.parse(self.schedule)

    @property
    def recompute_mode(self) -> RecomputeMode:
        """``recompute`` as the enum."""
        return RecomputeMode.parse(self.recompute)
