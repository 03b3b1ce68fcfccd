"""Text picture of a schedule: one row per rank, one column per time step.

Used in error messages, the documentation and the CLI, so that a user can see which micro-batch each rank
is working on and where the bubble is without running anything.
"""

from __future__ import annotations

from lightning_pipe.schedule.actions import PipelineSchedule
from lightning_pipe.schedule.simulate import simulate

_SYMBOL = {"F": "F", "B": "B", "I": "I", "W": "W"}


def render_schedule(schedule: PipelineSchedule, forward_time: int = 1, backward_time: int = 1) -> str:
    """Render the simulated timeline; each cell is ``<kind><micro-batch>`` or ``.`` when idle.

    With the default unit times every forward and backward fills one cell, which shows the
    order clearly; pass ``backward_time=2`` for the usual cost ratio.
    """
    result = simulate(schedule, forward_time, backward_time)
    steps = round(result.makespan)
    grid = [["."] * steps for _ in range(schedule.num_ranks)]
    for timed in result.timeline:
        if not timed.action.kind.is_compute:
            continue
        label = f"{_SYMBOL[timed.action.kind.value]}{timed.action.microbatch}"
        if schedule.num_stages != schedule.num_ranks:
            label += f"s{timed.action.stage_index}"
        for t in range(round(timed.start), round(timed.end)):
            grid[timed.rank][t] = label
    width = max([len(c) for row in grid for c in row] + [1])
    ranks = "" if schedule.num_stages == schedule.num_ranks else f" on {schedule.num_ranks} ranks"
    skips = ", ".join(f"{a}->{c}" for a, c in schedule.skips)
    header = (
        f"{schedule.name}: {schedule.num_stages} stages{ranks}, {schedule.num_microbatches} micro-batches, "
        f"bubble {result.bubble_fraction:.1%}" + (f", skips {skips}" if skips else "")
    )
    rows = [
        f"rank {r} | " + " ".join(cell.ljust(width) for cell in row).rstrip() for r, row in enumerate(grid)
    ]
    return "\n".join([header, *rows])
