"""Timelines written to files: :func:`write_chrome_trace` (JSON for Perfetto /
``chrome://tracing``: one track per rank, one complete event per action) and :func:`plot_timeline`
(a PNG: one row per rank, computations coloured by kind and labelled with their micro-batch, the
measured idle share in the title), for planned and recorded timelines alike (:mod:`.timeline`).

Pure data to file: no process group, no model. Matplotlib is imported only when plotting
(``pip install lightning-pipe[plot]``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_pipe.schedule.actions import ActionType
from lightning_pipe.schedule.timeline import SPAN, TimelineEvent, TimelineStats, timeline_stats

_SKIP_KINDS = frozenset(k.value for k in ActionType if k.is_skip)
_SKIP_COLOUR = "#b07aa1"


def chrome_trace(events: Sequence[TimelineEvent], name: str = "pipeline") -> dict[str, Any]:
    """The Chrome trace-event document of ``events``: one track (thread) per rank, times in µs.

    Every event is a complete event (``"ph": "X"``) named like ``"F3"`` or ``"SEND_F"`` with its
    stage and micro-batch in ``args``; metadata events name the process and each rank's track.
    """
    ranks = sorted({e.rank for e in events})
    trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank in ranks:
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
        trace.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}}
        )
    for e in events:
        category = "compute" if e.is_compute else "comm" if e.is_comm else SPAN
        args: dict[str, Any] = {"rank": e.rank}
        if e.stage is not None:
            args["stage"] = e.stage
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        trace.append(
            {
                "name": e.name,
                "cat": category,
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start * 1e6,
                "dur": max(e.duration, 0.0) * 1e6,
                "args": args,
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(
    events: Sequence[TimelineEvent], path: str | os.PathLike[str], name: str = "pipeline"
) -> Path:
    """Write ``events`` as a Chrome trace JSON file (open it in https://ui.perfetto.dev)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(events, name)))
    return out


# ---------------------------------------------------------------------- PNG


_KIND_COLOURS = {
    ActionType.FORWARD.value: "#8ecae6",
    ActionType.BACKWARD.value: "#fb8500",
    ActionType.BACKWARD_INPUT.value: "#e63946",
    ActionType.BACKWARD_WEIGHT.value: "#2a9d8f",
}
_KIND_NAMES = {
    ActionType.FORWARD.value: "forward (F)",
    ActionType.BACKWARD.value: "backward (B)",
    ActionType.BACKWARD_INPUT.value: "input gradient (I)",
    ActionType.BACKWARD_WEIGHT.value: "weight gradient (W)",
}
IDLE_MEANING = "1 - compute time / (ranks x makespan)"
"""What the idle share in a plot's title measures."""


def plot_timeline(
    events: Sequence[TimelineEvent],
    path: str | os.PathLike[str],
    title: str = "pipeline timeline",
    time_unit: str = "ms",
    row_labels: Mapping[int, str] | None = None,
    note: str = "",
) -> TimelineStats:
    """Draw ``events`` as a PNG, one row per rank; return the stats shown in the title.

    Computations are coloured by kind (forward, backward, and for zero-bubble schedules the input
    and weight gradients apart) and labelled with their micro-batch (and stage, when a rank holds
    several); communication is a thin grey bar under the row, named spans are hatched grey. Rows
    are labelled ``row_labels[rank]`` (e.g. the rank's coordinates), or ``rank r`` and the
    stages its events name. The title gives the makespan and the share of rank-time not spent
    computing (:data:`IDLE_MEANING`); ``note`` adds a line under it (what may skew it).
    """
    try:
        import matplotlib  # noqa: F401  (the package itself: a missing one fails here, by name)
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_timeline needs matplotlib: `pip install lightning-pipe[plot]` "
            "(or `pip install matplotlib`)."
        ) from err

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
    stats = timeline_stats(events)
    ranks = sorted(stats.busy)
    row = {rank: i for i, rank in enumerate(ranks)}
    origin = min((e.start for e in events), default=0.0)
    computes_per_rank = sum(1 for e in events if e.is_compute) / max(1, len(ranks))
    width = max(7.0, min(30.0, 2.5 + 0.45 * computes_per_rank))
    lines = [
        title,
        f"makespan {stats.makespan * scale:.3g} {time_unit}; ranks idle {stats.bubble_fraction:.1%} of it "
        f"({IDLE_MEANING})",
    ]
    if note:
        lines.append(note)
    fig = Figure(figsize=(width, 1.4 + 0.3 * len(lines) + 0.9 * max(1, len(ranks))), dpi=100)
    ax = fig.add_subplot()
    span_total = stats.makespan * scale
    # A rank holding several stages (interleaved) labels each box with its stage too.
    stages_of: dict[int, set[int]] = {}
    for e in events:
        if e.is_compute and e.stage is not None:
            stages_of.setdefault(e.rank, set()).add(e.stage)
    several = any(len(held) > 1 for held in stages_of.values())
    for e in events:
        y = row[e.rank]
        x0, w = (e.start - origin) * scale, max(e.duration, 0.0) * scale
        if e.is_compute:
            colour = _KIND_COLOURS.get(e.kind, "0.6")
            ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=[colour], edgecolors="white", linewidth=0.6)
            if span_total > 0 and w / span_total > 0.008:
                label = f"{e.microbatch}" + (f"\ns{e.stage}" if several and e.stage is not None else "")
                ax.text(x0 + w / 2, y, label, ha="center", va="center", fontsize=8, color="black")
        elif e.is_comm:
            skip = e.kind in _SKIP_KINDS  # a skip connection's message: its own colour
            ax.broken_barh([(x0, w)], (y + 0.42, 0.08), facecolors=[_SKIP_COLOUR if skip else "0.45"])
        else:
            ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=["0.9"], hatch="//", edgecolors="0.5")
            if span_total > 0 and w / span_total > 0.06:  # the legend names the narrow ones
                ax.text(x0 + w / 2, y, e.name, ha="center", va="center", fontsize=8)

    def row_label(rank: int) -> str:
        if row_labels is not None and rank in row_labels:
            return row_labels[rank]
        held = sorted(stages_of.get(rank, ()))
        stages = f"\nstage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}" if held else ""
        return f"rank {rank}{stages}"

    ax.set_yticks(range(len(ranks)), [row_label(r) for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, span_total if span_total > 0 else 1.0)
    ax.set_xlabel(f"time ({time_unit}); each box is labelled with its micro-batch")
    ax.set_title("\n".join(lines), fontsize=9)
    kinds = [k for k in _KIND_COLOURS if any(e.kind == k for e in events)]
    legend = [Patch(facecolor=_KIND_COLOURS[k], label=_KIND_NAMES[k]) for k in kinds]
    legend.append(Patch(facecolor="0.45", label="communication (posted to completed)"))
    if any(e.kind in _SKIP_KINDS for e in events):
        legend.append(Patch(facecolor=_SKIP_COLOUR, label="skip connection"))
    if any(e.kind == SPAN for e in events):
        spans = sorted({e.name for e in events if e.kind == SPAN})
        legend.append(Patch(facecolor="0.9", hatch="//", edgecolor="0.5", label=", ".join(spans)))
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.15),
        ncol=len(legend),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return stats
