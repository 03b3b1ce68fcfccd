"""The executed schedule of training steps, recorded on every rank and written at the end of
``fit`` (a plot or a Chrome trace): ``PipeTPStrategy(timeline=..., timeline_steps=...)``.

Training step 0 pays for first-time allocations and warm-up, so the recorded window starts at step
1 and holds ``timeline_steps`` steps (one by default: a readable picture). Step 0 is recorded on the
side and written only when no later step ran (``max_steps=1``), with a line in the title that says
so; when no training step ran at all, rank 0 says that instead of writing nothing.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_pipe.mesh import ParallelMesh
from lightning_pipe.runtime import PipelinePartition, TimelineRecorder, gather_timeline
from lightning_pipe.schedule.timeline_export import plot_timeline, write_chrome_trace


class TimelineRecording:
    """The recorders of one fit's timeline (``path`` ``None``: nothing is recorded)."""

    def __init__(self, path: str | None, steps: int = 1) -> None:
        self.path, self.steps = path, steps
        self._window: TimelineRecorder | None = None
        self._first: TimelineRecorder | None = None
        self._written = False

    def recorder_for(self, step: int, rank: int, device: torch.device) -> TimelineRecorder | None:
        """The recorder of training step ``step``: step 0's on the side, steps 1 to ``steps`` in
        the window, ``None`` after it. Creating one is collective (one time origin for all ranks):
        every rank asks at the same step. On CUDA its spans are the stream's (events)."""
        if self.path is None or step > self.steps:
            return None
        if step == 0:
            if self._first is None:
                self._first = TimelineRecorder(rank, device=device)
                self._first.start()
            return self._first
        if self._window is None:
            self._window = TimelineRecorder(rank, device=device)
            self._window.start()
        return self._window

    def not_written(self) -> None:
        """At the end of a fit that ran no training step (``max_steps=0``, or the loop was already
        done): say so, rather than write nothing."""
        if self.path is not None and not self._written:
            rank_zero_warn(
                f"pipe_tp: timeline={self.path!r}: no training step ran in this fit, so there is no "
                "timeline to write."
            )
        self._written = False

    def write(
        self,
        mesh: ParallelMesh,
        partition: PipelinePartition,
        schedule: str,
        device: torch.device,
        processes: int,
    ) -> None:
        """Write the recorded timeline (a collective: every rank gathers to rank 0)."""
        if self.path is None:
            return
        self._written = True
        recorder, notes = self._window, []
        if recorder is None and self._first is not None:
            recorder = self._first
            notes.append(
                "training step 0 only (its first-time allocations and warm-up included): train at "
                "least 2 steps to see a step without them"
            )
        self._window = self._first = None
        if recorder is None:
            rank_zero_warn(
                f"pipe_tp: timeline={self.path!r}: no training step ran in this fit, so there is no "
                "timeline to write."
            )
            return
        events = gather_timeline(recorder)
        if mesh.rank != 0:
            return
        n = self.steps
        steps = "step 0" if notes else ("step 1" if n == 1 else f"steps 1-{n}")
        if self.path.endswith(".png"):
            shared = _shared_cores_note(device, processes)
            stats = plot_timeline(
                events,
                self.path,
                title=f"pipe_tp {mesh.layout}, {schedule}, training {steps} as run",
                row_labels=_row_labels(mesh, partition),
                note="; ".join([*notes, *([shared] if shared else [])]),
            )
            rank_zero_info(
                f"pipe_tp: timeline of training {steps} written to {self.path} (ranks idle "
                f"{stats.bubble_fraction:.1%} of the makespan)"
            )
        else:
            write_chrome_trace(events, self.path)
            rank_zero_info(
                f"pipe_tp: Chrome trace of training {steps} written to {self.path} (open it in Perfetto)"
            )


def _row_labels(mesh: ParallelMesh, partition: PipelinePartition) -> dict[int, str]:
    """Each rank's row: its coordinates and the stages it holds."""
    layout, labels = mesh.layout, {}
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        stages = partition.stages_of_rank(c.pp_rank, layout.pipeline_parallel_size)
        dp = f" · dp {c.dp_rank}" if layout.data_parallel_size > 1 else ""
        held = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        labels[rank] = f"rank {rank}\npp {c.pp_rank} · tp {c.tp_rank}{dp}\n{held}"
    return labels


def _shared_cores_note(device: torch.device, processes: int) -> str:
    """What skews the idle share on this machine, if anything: CPU ranks sharing cores."""
    cores = os.cpu_count() or 1
    threads = processes * torch.get_num_threads()
    if device.type != "cpu" or threads <= cores:
        return ""
    return (
        f"{processes} processes x {torch.get_num_threads()} threads share {cores} CPU cores: "
        "time a rank waits for a core counts as compute, so the idle share understates the bubble"
    )
