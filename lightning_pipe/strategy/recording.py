"""The executed schedule of training steps 1-8, recorded on every rank and written at the end of
``fit`` (a plot or a Chrome trace): ``PipeTPStrategy(timeline=...)``."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_pipe.pipeline.schedules import ScheduleKind
from lightning_pipe.pipeline.timeline import (
    TimelineRecorder,
    gather_timeline,
    plot_timeline,
    write_chrome_trace,
)
from lightning_pipe.runtime import ParallelRuntime
from lightning_pipe.strategy.base import PipeTPParts

_TIMELINE_STEPS = (1, 9)  # skip step 0 (first-step allocations), record the next eight


class TimelineHooks(PipeTPParts):
    """Recording of the timeline for ``PipeTPStrategy``."""

    timeline: str | None
    schedule: ScheduleKind
    _recorder: TimelineRecorder | None
    _runtime: ParallelRuntime | None

    def _timeline_recorder(self, step: int) -> TimelineRecorder | None:
        """The recorder for training step ``step`` if it is in the recorded window (steps 1-8)."""
        if self.timeline is None or not _TIMELINE_STEPS[0] <= step < _TIMELINE_STEPS[1]:
            return None
        if self._recorder is None:
            self._recorder = TimelineRecorder(self.global_rank)
            self._recorder.start()  # collective: one time origin for all ranks
        return self._recorder

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        recorder = self._runtime.executor.recorder if self._runtime is not None else None
        if recorder is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The closure (this step's whole pipeline) runs inside optimizer.step: time what follows it.
        closure_end: list[float] = []

        def timed_closure() -> Any:
            result = closure()
            closure_end.append(time.perf_counter())
            return result

        output = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        if closure_end:
            recorder.add_span("optimizer step", closure_end[-1], time.perf_counter())  # type: ignore[attr-defined]
        return output

    def _write_timeline(self) -> None:
        """Write the recorded timeline (a collective: every rank gathers to rank 0)."""
        if self._recorder is None:
            return
        events = gather_timeline(self._recorder)
        self._recorder = None
        if self.global_rank == 0 and self.timeline is not None:
            if self.timeline.endswith(".png"):
                stats = plot_timeline(
                    events, self.timeline, title=f"pipe_tp {self.mesh.layout}, {self.schedule.value}"
                )
                rank_zero_info(
                    f"pipe_tp: timeline plot written to {self.timeline} (bubble {stats.bubble_fraction:.1%})"
                )
            else:
                write_chrome_trace(events, self.timeline)
                rank_zero_info(f"pipe_tp: Chrome trace written to {self.timeline} (open it in Perfetto)")
