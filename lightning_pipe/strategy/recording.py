"""The executed schedule of training steps, recorded on every rank and written at the end of
``fit`` (a plot or a Chrome trace): ``PipeTPStrategy(timeline=..., timeline_steps=...)``.

Training step 0 pays for first-time allocations and warm-up, so the recorded window starts at step
1 and holds ``timeline_steps`` steps (one by default: a readable picture). Step 0 is recorded on the
side and written only when no later step ran (``max_steps=1``), with a line in the title that says
so; when no training step ran at all, rank 0 says that instead of writing nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
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


class TimelineHooks(PipeTPParts):
    """Recording of the timeline for ``PipeTPStrategy``."""

    timeline: str | None
    timeline_steps: int
    schedule: ScheduleKind
    _recorder: TimelineRecorder | None
    _first_step: TimelineRecorder | None
    _timeline_written: bool
    _runtime: ParallelRuntime | None

    def _timeline_recorder(self, step: int) -> TimelineRecorder | None:
        """The recorder for training step ``step``: step 0's on the side, steps 1 to
        ``timeline_steps`` in the window, ``None`` after it."""
        if self.timeline is None or step > self.timeline_steps:
            return None
        if step == 0:
            if self._first_step is None:
                self._first_step = TimelineRecorder(self.global_rank)
                self._first_step.start()  # collective: one time origin for all ranks
            return self._first_step
        if self._recorder is None:
            self._recorder = TimelineRecorder(self.global_rank)
            self._recorder.start()
        return self._recorder

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # This step's recorder (the closure's training_step asks for the same one): the executor's
        # attribute still holds the previous step's here.
        recorder = self._timeline_recorder(self.module.trainer.global_step)
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

    def _row_labels(self) -> dict[int, str]:
        """Each rank's row: its coordinates and the stages it holds."""
        layout, labels = self.mesh.layout, {}
        for rank in range(layout.world_size):
            c = layout.coordinates(rank)
            stages = self.runtime.plan.stages_of_rank(c.pp_rank, layout.pipeline_parallel_size)
            dp = f" · dp {c.dp_rank}" if layout.data_parallel_size > 1 else ""
            held = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
            labels[rank] = f"rank {rank}\npp {c.pp_rank} · tp {c.tp_rank}{dp}\n{held}"
        return labels

    def _shared_cores_note(self) -> str:
        """What skews the idle share on this machine, if anything: CPU ranks sharing cores."""
        cores = os.cpu_count() or 1
        threads = self.num_processes * torch.get_num_threads()
        if self.root_device.type != "cpu" or threads <= cores:
            return ""
        return (
            f"{self.num_processes} processes x {torch.get_num_threads()} threads share {cores} CPU cores: "
            "time a rank waits for a core counts as compute, so the idle share understates the bubble"
        )

    def _timeline_not_written(self) -> None:
        """At the end of a fit that ran no training step (``max_steps=0``, or the loop was already
        done): say so, rather than write nothing."""
        if self.timeline is not None and not self._timeline_written:
            rank_zero_warn(
                f"pipe_tp: timeline={self.timeline!r}: no training step ran in this fit, so there is no "
                "timeline to write."
            )
        self._timeline_written = False

    def _write_timeline(self) -> None:
        """Write the recorded timeline (a collective: every rank gathers to rank 0)."""
        if self.timeline is None:
            return
        self._timeline_written = True
        recorder, notes = self._recorder, []
        if recorder is None and self._first_step is not None:
            recorder = self._first_step
            notes.append(
                "training step 0 only (its first-time allocations and warm-up included): train at "
                "least 2 steps to see a step without them"
            )
        self._recorder = self._first_step = None
        if recorder is None:
            rank_zero_warn(
                f"pipe_tp: timeline={self.timeline!r}: no training step ran in this fit, so there is no "
                "timeline to write."
            )
            return
        events = gather_timeline(recorder)
        if self.global_rank != 0:
            return
        n = self.timeline_steps
        steps = "step 0" if notes else ("step 1" if n == 1 else f"steps 1-{n}")
        if self.timeline.endswith(".png"):
            shared = self._shared_cores_note()
            stats = plot_timeline(
                events,
                self.timeline,
                title=f"pipe_tp {self.mesh.layout}, {self.schedule.value}, training {steps} as run",
                row_labels=self._row_labels(),
                note="; ".join([*notes, *([shared] if shared else [])]),
            )
            rank_zero_info(
                f"pipe_tp: timeline of training {steps} written to {self.timeline} (ranks idle "
                f"{stats.bubble_fraction:.1%} of the makespan)"
            )
        else:
            write_chrome_trace(events, self.timeline)
            rank_zero_info(
                f"pipe_tp: Chrome trace of training {steps} written to {self.timeline} (open it in Perfetto)"
            )
