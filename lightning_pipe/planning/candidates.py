"""The layouts a planner may choose between: every way to run one model on ``world`` processes
that the engine accepts, with the user's own choices kept as constraints.

A candidate fixes everything the step time and memory depend on: the three sizes (pipeline x
tensor x data = the world), what the data axis does with the state (replicated, ZeRO-1's sharded
optimizer, FSDP2's sharded parameters), the schedule and its stages per rank, the micro-batches
per batch and the recomputation. The enumeration only proposes what ``pipe_tp`` would accept
(the same rules :class:`~lightning_pipe.runtime.RuntimeOptions` checks), so that whichever
candidate wins can be run as it is: a schedule needing several pipeline ranks is never paired with
one, FSDP2's per-layer resharding never with a split backward, a data axis of one replica never
with a sharded mode (there would be nothing to shard over).

Sizes a user set are constraints, not suggestions (:class:`Constraints`: ``None`` is free), and a
constraint no layout can meet is an error naming it, before any measurement is made.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.schedule.builders import ScheduleKind


class DataMode(enum.Enum):
    """What the data-parallel replicas do with the model's state."""

    REPLICATED = "replicated"
    """Every replica holds the whole stage's parameters, gradients and optimizer state; gradients
    are all-reduced (the bucketed reducer)."""
    ZERO1 = "zero1"
    """``shard_optimizer_state=True``: the optimizer state is split over the replicas; gradients
    are reduce-scattered and the updated parameters all-gathered."""
    FSDP2 = "fsdp2"
    """``shard_parameters=True``: parameters, gradients and optimizer state split over the
    replicas, the parameters gathered for compute."""

    @classmethod
    def parse(cls, value: DataMode | str) -> DataMode:
        if isinstance(value, DataMode):
            return value
        for mode in cls:
            if mode.value == str(value).lower():
                return mode
        raise ValueError(f"data mode must be one of {[m.value for m in cls]}, got {value!r}.")


MAX_VIRTUAL_STAGES = 4
"""Stages per rank tried for the interleaved schedule when the user leaves it free: beyond a few,
the bubble gained is small against the messages added (each micro-batch crosses every rank ``v``
times)."""


MAX_MICROBATCHES = 64
"""The most micro-batches per batch tried when the user leaves them free: past a few times the
pipeline size the bubble gained is small (1F1B's is ``(p - 1) / (m + p - 1)``), each micro-batch
pays the layers' fixed costs again, and simulating the schedule grows with ``m``. A number the user
sets is tried whatever its size."""


@dataclass(frozen=True)
class Constraints:
    """The choices the user made; ``None`` leaves a choice to the planner."""

    pipeline_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    data_mode: DataMode | None = None
    schedule: ScheduleKind | None = None
    virtual_stages: int | None = None
    num_microbatches: int | None = None
    recompute: RecomputeMode | None = None
    reshard_after_forward: bool | None = None
    """Under FSDP2 only; ``None``: both ways are tried where the schedule allows them."""

    def __post_init__(self) -> None:
        for name in (
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "data_parallel_size",
            "virtual_stages",
            "num_microbatches",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None (free), got {value!r}.")
        if self.data_mode is not None:
            object.__setattr__(self, "data_mode", DataMode.parse(self.data_mode))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", ScheduleKind.parse(self.schedule))
        if self.recompute is not None:
            object.__setattr__(self, "recompute", RecomputeMode.parse(self.recompute))

    def describe(self) -> str:
        """The constraints set, as ``name=value`` (for error messages)."""
        set_ = [
            f"{f.name}={getattr(v, 'value', v)!r}"
            for f in fields(self)
            if (v := getattr(self, f.name)) is not None
        ]
        return ", ".join(set_) or "no constraints"


@dataclass(frozen=True)
class ModelShape:
    """What the model allows, independent of any measurement."""

    num_layers: int
    """Pipeline layers (``configure_pipeline()``'s, or a Hugging Face model's plan's)."""
    tensor_parallel_sizes: frozenset[int] = frozenset({1})
    """The tensor sizes the model's plan accepts (each dividing its heads and split dimensions:
    the plan's own checks decide); ``{1}`` for a model without a plan."""


@dataclass(frozen=True)
class Candidate:
    """One layout, schedule and memory policy ``pipe_tp`` can run."""

    pipeline_parallel_size: int
    tensor_parallel_size: int
    data_parallel_size: int
    data_mode: DataMode
    schedule: ScheduleKind
    virtual_stages: int
    num_microbatches: int
    recompute: RecomputeMode
    reshard_after_forward: bool = False
    """FSDP2 only: gather and free each layer's parameters around every use (least memory)."""

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.virtual_stages

    def __str__(self) -> str:
        parts = [f"pp={self.pipeline_parallel_size}"]
        if self.tensor_parallel_size > 1:
            parts.append(f"tp={self.tensor_parallel_size}")
        if self.data_parallel_size > 1:
            mode = self.data_mode.value
            if self.data_mode is DataMode.FSDP2 and self.reshard_after_forward:
                mode += " reshard"
            parts.append(f"dp={self.data_parallel_size} {mode}")
        if self.pipeline_parallel_size > 1:
            v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"{self.schedule.value}{v}")
        parts.append(f"m={self.num_microbatches}")
        if self.recompute is not RecomputeMode.NEVER:
            parts.append(f"recompute {self.recompute.value}")
        return ", ".join(parts)

    def options(self) -> dict[str, object]:
        """The ``PipeTPStrategy`` arguments that run this candidate."""
        return {
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "schedule": self.schedule.value,
            "virtual_stages": self.virtual_stages,
            "num_microbatches": self.num_microbatches,
            "recompute": self.recompute.value,
            "shard_optimizer_state": self.data_mode is DataMode.ZERO1,
            "shard_parameters": self.data_mode is DataMode.FSDP2,
            **(
                {"reshard_after_forward": self.reshard_after_forward}
                if self.data_mode is DataMode.FSDP2
                else {}
            ),
            "partition": "time",
        }


def microbatch_rows(candidates: Iterable[Candidate], batch: int) -> list[int]:
    """The micro-batch sizes (samples) ``candidates`` run for a global batch of ``batch``: what the
    layers are best timed at (:func:`~.measure.measurement_sizes`)."""
    return sorted({batch // (c.data_parallel_size * c.num_microbatches) for c in candidates})


def shards_parameters(candidates: Iterable[Candidate]) -> bool:
    """Whether any of ``candidates`` shards its parameters (FSDP2 over more than one replica):
    only then does the plan need the DTensor step's overhead measured."""
    return any(c.data_mode is DataMode.FSDP2 and c.data_parallel_size > 1 for c in candidates)


def splits_backward(candidates: Iterable[Candidate]) -> bool:
    """Whether any of ``candidates`` runs a zero-bubble schedule (its backward split into input and
    weight passes): only then does the plan need the split timed per layer."""
    return any(c.schedule.splits_backward for c in candidates)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick(free: list[int], fixed: int | None) -> list[int]:
    return free if fixed is None else [v for v in free if v == fixed]


def _runs_as_one_f_one_b(kind: ScheduleKind, m: int, c: Constraints) -> bool:
    """Whether ``kind`` at ``m`` micro-batches runs 1F1B's very actions, 1F1B being enumerated too:
    with one micro-batch GPipe and 1F1B both run each stage's forward then its backward (from two
    micro-batches on, the last stage orders them apart: F0 B0 F1 B1 against F0 F1 B1 B0). Listing
    both would rank one layout twice, the two predictions equal and their measurements apart only
    by noise. The rule is checked against the built schedules in the tests."""
    return kind is ScheduleKind.GPIPE and m == 1 and c.schedule is None


def _schedules(pp: int, num_layers: int, c: Constraints) -> Iterator[tuple[ScheduleKind, int]]:
    """The schedules (with stages per rank) valid for ``pp`` pipeline ranks."""
    if pp == 1:
        # One stage: every schedule is the same forwards-then-backwards; 1F1B names it, unless the
        # user named another (zb_h1 and interleaved need a pipeline).
        kind = c.schedule or ScheduleKind.ONE_F_ONE_B
        if kind in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B) and c.virtual_stages in (None, 1):
            yield kind, 1
        return
    for kind in ScheduleKind:
        if c.schedule is not None and kind is not c.schedule:
            continue
        if kind is ScheduleKind.INTERLEAVED_1F1B:
            top = (
                num_layers // pp
                if c.virtual_stages is not None
                else min(MAX_VIRTUAL_STAGES, num_layers // pp)
            )
            for v in _pick(list(range(2, top + 1)), c.virtual_stages):
                yield kind, v
        elif c.virtual_stages in (None, 1):
            yield kind, 1


def enumerate_candidates(
    world: int, shape: ModelShape, batch: int, constraints: Constraints
) -> list[Candidate]:
    """Every candidate for ``world`` processes and a global ``batch`` of ``batch`` samples (each
    replica splits ``batch / dp`` samples into micro-batches), meeting ``constraints``.

    Raises ``ValueError`` when none does, naming the constraints and why.
    """
    if world < 1 or batch < 1 or shape.num_layers < 1:
        raise ValueError(
            f"The world ({world}), the batch ({batch}) and the layers ({shape.num_layers}) must be >= 1."
        )
    c = constraints
    recomputes = [c.recompute] if c.recompute is not None else [RecomputeMode.NEVER, RecomputeMode.ALWAYS]
    found: list[Candidate] = []
    for tp in _pick(divisors(world), c.tensor_parallel_size):
        if tp not in shape.tensor_parallel_sizes:
            continue
        for pp in _pick(divisors(world // tp), c.pipeline_parallel_size):
            if pp > shape.num_layers:
                continue
            dp = world // (tp * pp)
            if c.data_parallel_size not in (None, dp) or batch % dp:
                continue
            if dp == 1:
                modes = [c.data_mode or DataMode.REPLICATED]
            else:
                modes = [c.data_mode] if c.data_mode is not None else list(DataMode)
            for kind, v in _schedules(pp, shape.num_layers, c):
                if pp * v > shape.num_layers:
                    continue
                counts = [m for m in divisors(batch // dp) if m <= MAX_MICROBATCHES or c.num_microbatches]
                for m in _pick(counts, c.num_microbatches):
                    if pp > 1 and _runs_as_one_f_one_b(kind, m, c):
                        continue
                    for mode in modes:
                        for reshard in _reshards(mode, pp, v, kind, c):
                            for recompute in recomputes:
                                found.append(Candidate(pp, tp, dp, mode, kind, v, m, recompute, reshard))
    if not found:
        raise ValueError(_none_possible(world, shape, batch, c))
    return found


def _reshards(mode: DataMode, pp: int, v: int, kind: ScheduleKind, c: Constraints) -> list[bool]:
    if mode is not DataMode.FSDP2:
        return [False]
    if c.reshard_after_forward is not None:
        # Resharding reduces every backward's gradients: a split backward computes them later.
        return [] if c.reshard_after_forward and kind.splits_backward else [c.reshard_after_forward]
    if pp == 1 and v == 1:
        return [True]  # the strategy's own choice without a pipeline (nothing is lost by it)
    return [False] if kind.splits_backward else [False, True]


def _none_possible(world: int, shape: ModelShape, batch: int, c: Constraints) -> str:
    tps = sorted(t for t in shape.tensor_parallel_sizes if world % t == 0)
    return (
        f"No layout of {world} processes meets {c.describe()} for this model ({shape.num_layers} pipeline "
        f"layers, tensor sizes its plan accepts: {tps}) and a batch of {batch}: pipeline x tensor x data "
        "must equal the processes, the pipeline have at most one stage per layer, the data size and the "
        "micro-batches divide the batch. Loosen a constraint (leave it None) or change the devices."
    )
