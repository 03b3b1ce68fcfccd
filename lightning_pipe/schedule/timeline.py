"""Timelines of pipeline steps as data: what each rank did when, planned or recorded.

A schedule's bubble is a number on paper (:mod:`.simulate`); what a real run loses is only visible
when every rank's actions are put side by side in time. Both become one list of
:class:`TimelineEvent` so that the same exporters (:mod:`.timeline_export`: a Chrome trace, a PNG)
serve either:

* **Planned**: :func:`events_from_simulation` converts the simulator's timeline.
* **Recorded**: :class:`~lightning_pipe.execution.timeline.TimelineRecorder`, given to the
  executor, keeps one event per action it ran (recording runs beside the executor, in
  :mod:`lightning_pipe.execution`; this module stays pure data).

Times are seconds from the timeline's origin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_pipe.schedule.actions import Action, ActionType
from lightning_pipe.schedule.simulate import SimulationResult, TimedAction

SPAN = "span"
"""``TimelineEvent.kind`` of a named span that is not a schedule action (e.g. the optimizer step)."""

_COMPUTE_KINDS = frozenset(k.value for k in ActionType if k.is_compute)


@dataclass(frozen=True)
class TimelineEvent:
    """One action (or named span) of one rank, in seconds from the timeline's origin."""

    rank: int
    name: str
    """``"F3"`` / ``"B3"`` for computations (kind and micro-batch), ``"SEND_F"`` etc. for
    communication, the span's own name for a span."""
    kind: str
    """The ``ActionType`` value (``"F"``, ``"B"``, ``"SEND_F"``, ...) or :data:`SPAN`."""
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind != SPAN and not self.is_compute

    @classmethod
    def of_action(cls, rank: int, action: Action, start: float, end: float) -> TimelineEvent:
        kind = action.kind
        name = f"{kind.value}{action.microbatch}" if kind.is_compute else kind.value
        if action.peer_stage is not None:  # a skip connection's message names its other end
            arrow = ">" if kind in (ActionType.SEND_SKIP, ActionType.SEND_SKIP_GRAD) else "<"
            name += f"{arrow}{action.peer_stage}"
        return cls(rank, name, kind.value, start, end, action.stage_index, action.microbatch)


@dataclass(frozen=True)
class TimelineStats:
    """Summary of a timeline: wall span, compute time per rank and the bubble it implies."""

    makespan: float
    """From the earliest start to the latest end over all events."""
    busy: dict[int, float]
    """Rank -> total compute (forward/backward) time."""

    @property
    def num_ranks(self) -> int:
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """``1 - sum(compute time) / (ranks * makespan)``: the share of rank-time not computing."""
        if self.makespan <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (self.num_ranks * self.makespan)


def timeline_stats(events: Sequence[TimelineEvent]) -> TimelineStats:
    """Makespan, compute time per rank and measured bubble fraction of ``events``."""
    if not events:
        return TimelineStats(0.0, {})
    busy: dict[int, float] = {}
    for event in events:
        busy.setdefault(event.rank, 0.0)
        if event.is_compute:
            busy[event.rank] += event.duration
    makespan = max(e.end for e in events) - min(e.start for e in events)
    return TimelineStats(makespan, dict(sorted(busy.items())))


def _order(event: TimelineEvent) -> tuple[float, int, float]:
    return (event.start, event.rank, event.end)


def in_order(events: Iterable[TimelineEvent]) -> list[TimelineEvent]:
    """``events`` sorted by start time (then rank, then end)."""
    return sorted(events, key=_order)


def events_from_simulation(
    simulated: SimulationResult | Iterable[TimedAction], unit: float = 1.0
) -> list[TimelineEvent]:
    """The simulator's planned timeline as events; one simulated time unit lasts ``unit`` seconds."""
    timeline = simulated.timeline if isinstance(simulated, SimulationResult) else simulated
    events = [TimelineEvent.of_action(t.rank, t.action, t.start * unit, t.end * unit) for t in timeline]
    return in_order(events)
