"""The timestamps a timeline is made of: the host's clock on a CPU, events on a CUDA stream.

On a CPU an action's work is done when its call returns, so ``time.perf_counter()`` around the call
is its span. On CUDA the call returns once its kernels are queued: a host clock would time the
launch of a compute action and next to nothing of an exchange (whose wait only makes the stream
wait), and the idle share it shows would not be the GPU's bubble (docs/gpu.md, F4). A CUDA event
recorded on the current stream before and after an action completes when the stream reaches it,
so the span between two events is the time the stream spent on the action, waits for exchanges
included; that is what Nsight shows and what the pipeline papers call the bubble.

Reading an event's time makes the host wait for it, which a step must not do (issue 44: no host
synchronisation inside a step): a :class:`DeviceEventClock` stamps with events and turns them into
seconds only when the timeline is read, after the step. Both clocks speak host seconds
(``perf_counter``) in the end: a device clock's origin is an event recorded with the stream idle,
at a known host time, so its times line up with host spans and with the other ranks' clocks
(:mod:`.clock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """Makes stamps while a step runs, and reads them as host seconds afterwards."""

    def stamp(self) -> Any:
        """A mark of "now" in the work's order (cheap: no waiting)."""
        ...

    def seconds(self, stamp: Any) -> float:
        """The stamp as ``time.perf_counter()`` seconds (may wait for the device: call after the step)."""
        ...

    def rebase(self) -> None:
        """Line the clock up with the host's again (may wait for the device: between steps)."""
        ...

    @property
    def origin_error(self) -> float:
        """How far, at most, the last :meth:`rebase` put the clock's times from the host's, in
        seconds (0 for the host's own clock)."""
        ...


class HostClock:
    """``time.perf_counter()``: the span of a call is the span of its work (CPU, gloo)."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamp: Any) -> float:
        return float(stamp)

    def rebase(self) -> None:
        """Nothing to line up: it is the host's clock."""

    @property
    def origin_error(self) -> float:
        return 0.0


class DeviceEventClock:
    """Events recorded on the current stream of ``device``, read as host seconds after the step.

    Args:
        device: the device whose current stream the events are recorded on.
        event: makes one timing event (default ``torch.cuda.Event(enable_timing=True)``); an
            event has ``record(stream)``, ``synchronize()`` and ``elapsed_time(other)``
            (milliseconds), as CUDA's do.
        synchronize: waits until ``device`` has done all queued work (default
            ``torch.cuda.synchronize``).

    The origin is set when the clock is made (and by :meth:`rebase`): the device is drained and an
    event recorded on the idle stream, which completes at once, between two reads of the host's
    clock, so that event's time is their midpoint (to within half the time between them, and the
    launch latency: microseconds).
    """

    REBASE_TRIES = 5
    """Origins taken at each rebase, the one between the closest host readings kept: a process
    descheduled between the readings (a loaded machine) would put every time of the recording off
    by as long as it waited, milliseconds, which the closest of a few readings leaves out."""

    def __init__(
        self,
        device: torch.device,
        event: Callable[[], Any] | None = None,
        synchronize: Callable[[torch.device], None] | None = None,
    ) -> None:
        self.device = device
        self._event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize if synchronize is not None else torch.cuda.synchronize
        self._origin_event: Any = None
        self._origin_seconds = 0.0
        self._origin_error = 0.0
        self.rebase()

    def _stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def rebase(self) -> None:
        """A new origin (waits for the device: call between steps, e.g. when recording starts)."""
        self._synchronize(self.device)
        closest = float("inf")
        for _ in range(self.REBASE_TRIES):
            event = self._event()
            before = time.perf_counter()
            event.record(self._stream())
            after = time.perf_counter()
            if after - before < closest:
                closest = after - before
                self._origin_event, self._origin_seconds = event, (before + after) / 2
        self._origin_error = closest / 2

    @property
    def origin_error(self) -> float:
        """Half the time between the host readings around the origin's event (launch latency aside)."""
        return self._origin_error

    def stamp(self) -> Any:
        event = self._event()
        event.record(self._stream())
        return event

    def seconds(self, stamp: Any) -> float:
        stamp.synchronize()
        return self._origin_seconds + self._origin_event.elapsed_time(stamp) / 1e3


def clock_for(device: torch.device | None) -> Clock:
    """The clock whose spans are the work's on ``device``: events on CUDA, the host's elsewhere."""
    if device is not None and device.type == "cuda":
        return DeviceEventClock(device)
    return HostClock()
