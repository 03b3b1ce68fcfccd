"""Recording a timeline while pipeline steps run: a :class:`TimelineRecorder` is given to the
executor (``PipelineExecutor.run(..., recorder=...)``); it keeps one event per action (a
communication batch reports each of its actions with the batch's span) and any extra named span
(``with recorder.span("optimizer step"): ...``). :func:`gather_timeline` collects every rank's
events on one rank; :mod:`lightning_pipe.schedule.timeline_export` writes them (Chrome trace, PNG).

Plain torch and Python only (no Lightning), so the engine can be profiled without a Trainer. Times
are ``time.perf_counter()`` seconds relative to the recorder's origin. :meth:`TimelineRecorder.start`
gives all ranks one origin (:mod:`.clock`). On CUDA the spans are the stream's, from events
(:mod:`.stamps`), read when the events are first asked for, after the step: recording makes the
host wait for the device only when a recording starts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.execution.clock import common_origin
from lightning_pipe.execution.stamps import Clock, clock_for
from lightning_pipe.schedule.actions import Action
from lightning_pipe.schedule.timeline import SPAN, TimelineEvent, in_order


class TimelineRecorder:
    """Collects this rank's events; pass it as ``PipelineExecutor.run(..., recorder=...)``.

    Args:
        rank: the rank its events belong to (default: the global rank, or 0 without a group).
        t0: origin of the times, in ``time.perf_counter()`` seconds (default: now).
        device: where the work runs; on CUDA the spans come from events on its current stream
            (:class:`~lightning_pipe.execution.stamps.DeviceEventClock`), elsewhere from the host's
            clock.
        clock: the stamps' clock, instead of the one ``device`` implies.
    """

    def __init__(
        self,
        rank: int | None = None,
        t0: float | None = None,
        device: torch.device | None = None,
        clock: Clock | None = None,
    ) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.clock = clock if clock is not None else clock_for(device)
        self.t0 = time.perf_counter() if t0 is None else t0
        self._events: list[TimelineEvent] = []
        self._pending: list[tuple[Action | str, Any, Any]] = []
        """What was recorded since :attr:`events` was last read: (action or span name, start stamp,
        end stamp), read into events then (a device clock's stamps wait for the device)."""
        self.origin_error = 0.0
        """How far this rank's times may be from the group's first rank's clock, at most, in
        seconds: half the shortest round trip of :meth:`start`'s estimate (0 on that rank), plus
        how far the clock's own origin may be from the host's (a device clock's)."""

    @property
    def events(self) -> list[TimelineEvent]:
        """The recorded events, in the order they were recorded (reading them waits for the device
        to reach the last one: read after the step)."""
        for what, start, end in self._pending:
            begin, finish = self.clock.seconds(start) - self.t0, self.clock.seconds(end) - self.t0
            if isinstance(what, str):
                self._events.append(TimelineEvent(self.rank, what, SPAN, begin, finish))
            else:
                self._events.append(TimelineEvent.of_action(self.rank, what, begin, finish))
        self._pending.clear()
        return self._events

    def stamp(self) -> Any:
        """Now, in this recorder's clock (a host time, or an event on the device's stream)."""
        return self.clock.stamp()

    def __call__(self, action: Action, start: Any, end: Any) -> None:
        """The executor's hook: record ``action`` run between the stamps ``start`` and ``end``."""
        self._pending.append((action, start, end))

    def start(self, group: dist.ProcessGroup | None = None) -> None:
        """Forget recorded events and set a common origin on every rank of ``group``.

        A collective (call it on every rank of the group at the same point, e.g. before a step).
        Ranks leave a barrier up to milliseconds apart, so the origin is not "now" on each rank:
        every rank estimates its clock's offset to the group's first rank by a few ping-pong
        exchanges (keeping the one with the shortest round trip, so the error is at most half of
        it) and takes that rank's "now" as the origin. Without a process group it is just "now".
        The clock is rebased first (a device clock waits for the device), so that its stamps and
        the host's clock agree from here on.
        """
        self._events.clear()
        self._pending.clear()
        self.clock.rebase()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            self.t0, self.origin_error = time.perf_counter(), self.clock.origin_error
            return
        self.t0, error = common_origin(group)
        self.origin_error = error + self.clock.origin_error

    def add_span(self, name: str, start: Any, end: Any) -> None:
        """Record a named span that is not a schedule action, between two stamps of
        :meth:`stamp` (with the host's clock: ``perf_counter`` seconds)."""
        self._pending.append((name, start, end))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the time spent in the ``with`` block as a span called ``name``."""
        start = self.stamp()
        try:
            yield
        finally:
            self.add_span(name, start, self.stamp())


def gather_timeline(
    recorder: TimelineRecorder | Sequence[TimelineEvent],
    group: dist.ProcessGroup | None = None,
    dst: int = 0,
    all_ranks: bool = False,
) -> list[TimelineEvent]:
    """Every rank's events, sorted by start time, on global rank ``dst`` (``[]`` elsewhere).

    A collective over ``group`` (default: the world): every rank of it must call it. With
    ``all_ranks=True`` every rank gets the whole timeline. Without an initialised process group it
    returns the local events.
    """
    local = list(recorder.events if isinstance(recorder, TimelineRecorder) else recorder)
    if not (dist.is_available() and dist.is_initialized()):
        return in_order(local)
    size = dist.get_world_size(group)
    if all_ranks:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, local, group=group)
    else:
        is_dst = dist.get_rank() == dst
        parts = [None] * size if is_dst else []
        dist.gather_object(local, parts if is_dst else None, dst=dst, group=group)
        if not is_dst:
            return []
    return in_order(e for part in parts for e in (part or []))
