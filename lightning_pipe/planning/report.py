"""The plan as a person reads it: the top candidates in a table, and one line on why the winner won.

The table shows what the choice rests on (predicted step time, and its parts on the busiest rank;
peak memory per rank) so that a surprising pick can be checked against the measurement that led to
it. The line compares the winner with the best candidate of another layout (other sizes or data
mode: the next row is often the same layout with other micro-batches, which says little), names
the part of the step where the loser loses most, and says when something faster was ruled out by
memory.
"""

from __future__ import annotations

from lightning_pipe.planning.cost_model import Prediction
from lightning_pipe.planning.costs import format_bytes
from lightning_pipe.planning.planner import TIE, Plan, schedule, shared, traffic

NOT_COUNTED = (
    "Predicted from one device's measurements; memory counts parameters, gradients, optimizer state "
    "and activations (not the allocator's slack or framework buffers); time {optimizer}."
)


_PARTS = {
    "compute_seconds": "compute",
    "bubble_seconds": "pipeline bubble",
    "tensor_seconds": "tensor-parallel all-reduces",
    "data_seconds": "data-parallel communication",
    "recompute_seconds": "recomputation",
    "optimizer_seconds": "the optimizer step",
    "shared_compute_seconds": "waiting for the shared cores",
    "step_collectives_seconds": "the runtime's per-step collectives",
}


def _layout(p: Prediction) -> tuple[int, int, int, str, bool]:
    c = p.candidate
    return (
        c.pipeline_parallel_size,
        c.tensor_parallel_size,
        c.data_parallel_size,
        c.data_mode.value,
        c.reshard_after_forward,
    )


def format_table(plan: Plan, top: int = 5) -> str:
    """The ``top`` candidates that fit (or, when none fits, the ``top`` smallest) as a text table."""
    rows = list(plan.fitting[:top]) or list(plan.predictions[:top])
    best = rows[0].step_seconds if rows else 0.0
    header = (
        "#",
        "layout",
        "step s",
        "vs best",
        "peak/rank",
        "compute",
        "bubble",
        "tp comm",
        "dp comm",
        "recompute",
        "optimizer",
        "shared cores",
    )
    lines = [header]
    for i, p in enumerate(rows, 1):
        lines.append(
            (
                str(i),
                str(p.candidate),
                f"{p.step_seconds:.4g}",
                f"{p.step_seconds / best:.2f}x" if best and p.fits else "-",
                format_bytes(p.peak_bytes) + ("" if p.fits else " (over)"),
                f"{p.compute_seconds:.3g}",
                f"{p.bubble_seconds:.3g}",
                f"{p.tensor_seconds:.3g}",
                f"{p.data_seconds:.3g}",
                f"{p.recompute_seconds:.3g}",
                f"{p.optimizer_seconds:.3g}",
                f"{p.shared_compute_seconds:.3g}",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [
        "  ".join(
            cell.ljust(w) if i == 1 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def why(plan: Plan) -> str:
    """One line: the winner, the best other layout and where it loses; or the refusal."""
    best = plan.best
    if best is None:
        return f"Nothing fits: the model {plan.refusal}."
    fitting = plan.fitting
    over = len(plan.predictions) - len(fitting)
    limit = format_bytes(plan.memory_bytes)
    tail = f"; {over} of {len(plan.predictions)} candidates need more than {limit} per rank" if over else ""
    faster = [p for p in plan.predictions if not p.fits and p.step_seconds < best.step_seconds]
    if faster:
        quickest = min(faster, key=lambda p: p.step_seconds)
        tail += f" (the fastest of them, {quickest.candidate}, {format_bytes(quickest.peak_bytes)})"
    other = next((p for p in fitting if _layout(p) != _layout(best)), None)
    if other is None:
        alternatives = (
            "the only layout that fits"
            if len(fitting) == 1 or not fitting[1:]
            else "every other candidate is this layout"
        )
        return f"{best.candidate} won: {alternatives}{tail}."
    # The planner's group of ties is measured from the fastest prediction that fits, which the
    # winner (chosen within the group) need not be.
    if other.step_seconds <= min(p.step_seconds for p in fitting) * (1 + TIE):
        return (
            f"{best.candidate} won: {best.step_seconds:.3g} s per step predicted, as fast as "
            f"{other.candidate} and chosen for {_tie_reason(best, other)}{tail}."
        )
    gaps = {name: getattr(other, attr) - getattr(best, attr) for attr, name in _PARTS.items()}
    part, gap = max(gaps.items(), key=lambda item: item[1])
    slower = other.step_seconds / best.step_seconds - 1
    return (
        f"{best.candidate} won: {best.step_seconds:.3g} s per step predicted, {slower:.0%} faster than the "
        f"best other layout ({other.candidate}, {other.step_seconds:.3g} s), which spends {gap:.3g} s more "
        f"on {part}{tail}."
    )


def _tie_reason(best: Prediction, other: Prediction) -> str:
    """The first of the planner's tie-breaks (:mod:`.planner`) that tells the two apart."""
    if shared(best) < shared(other):
        return (
            f"its shorter wait for shared cores ({best.shared_compute_seconds:.3g} s against "
            f"{other.shared_compute_seconds:.3g} s: fewer processes compute at once; in ties on "
            "shared cores such layouts measured faster)"
        )
    if schedule(best) < schedule(other):
        return (
            f"its shorter schedule on devices of their own ({best.schedule_seconds:.3g} s against "
            f"{other.schedule_seconds:.3g} s: less bubble)"
        )
    if traffic(best) < traffic(other):
        return (
            f"less data-parallel traffic ({best.data_traffic_seconds:.3g} s against "
            f"{other.data_traffic_seconds:.3g} s, hidden or not)"
        )
    if best.peak_bytes < other.peak_bytes:
        mine, theirs = format_bytes(best.peak_bytes), format_bytes(other.peak_bytes)
        return f"its lower peak memory ({mine} against {theirs} per rank)"
    if best.communicating_processes < other.communicating_processes:
        return (
            f"collectives over fewer processes ({best.communicating_processes} against "
            f"{other.communicating_processes})"
        )
    return "being the simpler layout"


def render(plan: Plan, top: int = 5) -> str:
    """The table, the line, and what the numbers leave out."""
    # The optimizer step is in the time only where it was measured (measure_model(optimizer=...)).
    timed = any(p.optimizer_seconds > 0 for p in plan.predictions)
    optimizer = "counts the optimizer step as timed" if timed else "leaves out the optimizer step"
    return "\n".join([format_table(plan, top), "", why(plan), NOT_COUNTED.format(optimizer=optimizer)])
