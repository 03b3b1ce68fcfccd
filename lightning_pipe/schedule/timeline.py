"""Timelines of pipeline steps: record what each rank did when, and draw or export it.

A schedule's bubble is a number on paper (:mod:`.simulate`); what a real run loses is only visible
when every rank's actions are put side by side in time. This module turns both into one list of
:class:`TimelineEvent` so that the same exporters serve either:

* **Recorded**: a :class:`TimelineRecorder` is given to the executor; it keeps one
  event per action (a communication batch reports each of its actions with the batch's span) and
  any extra named span (``with recorder.span("optimizer step"): ...``). :func:`gather_timeline`
  collects every rank's events on one rank.
* **Planned**: :func:`events_from_simulation` converts the simulator's timeline.

Exports: :func:`write_chrome_trace` (JSON for Perfetto / ``chrome://tracing``: one track per rank,
one complete event per action) and :func:`plot_timeline` (a PNG: one row per rank, computations
coloured by kind and labelled with their micro-batch, the measured idle share in the title).
Matplotlib is imported only when plotting (``pip install lightning-pipe[plot]``).

Plain torch and Python only (no Lightning), so the engine can be profiled without a Trainer. Times
are ``time.perf_counter()`` seconds relative to the recorder's origin. :meth:`TimelineRecorder.start`
gives all ranks one origin by measuring each clock's offset to the first rank's (ping-pong, as NTP
does), because ranks leave a barrier up to milliseconds apart, more than a forward often takes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.schedule.actions import Action, ActionType
from lightning_pipe.schedule.simulate import SimulationResult, TimedAction

SPAN = "span"
"""``TimelineEvent.kind`` of a named span that is not a schedule action (e.g. the optimizer step)."""

_COMPUTE_KINDS = frozenset(k.value for k in ActionType if k.is_compute)
_SKIP_KINDS = frozenset(k.value for k in ActionType if k.is_skip)
_SKIP_COLOUR = "#b07aa1"


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


class TimelineRecorder:
    """Collects this rank's events; set an instance as ``PipelineExecutor.recorder``.

    Args:
        rank: the rank its events belong to (default: the global rank, or 0 without a group).
        t0: origin of the times, in ``time.perf_counter()`` seconds (default: now).
    """

    def __init__(self, rank: int | None = None, t0: float | None = None) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.t0 = time.perf_counter() if t0 is None else t0
        self.events: list[TimelineEvent] = []
        self.origin_error = 0.0
        """How far this rank's origin may be from the group's first rank's, at most, in seconds
        (half the shortest round trip of :meth:`start`'s estimate; 0 on that rank)."""

    def __call__(self, action: Action, start: float, end: float) -> None:
        """The executor's hook: record ``action`` run from ``start`` to ``end`` (perf_counter s)."""
        self.events.append(TimelineEvent.of_action(self.rank, action, start - self.t0, end - self.t0))

    def start(self, group: dist.ProcessGroup | None = None) -> None:
        """Forget recorded events and set a common origin on every rank of ``group``.

        A collective (call it on every rank of the group at the same point, e.g. before a step).
        Ranks leave a barrier up to milliseconds apart, so the origin is not "now" on each rank:
        every rank estimates its clock's offset to the group's first rank by a few ping-pong
        exchanges (keeping the one with the shortest round trip, so the error is at most half of
        it) and takes that rank's "now" as the origin. Without a process group it is just "now".
        """
        self.events.clear()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            self.t0, self.origin_error = time.perf_counter(), 0.0
            return
        self.t0, self.origin_error = _common_origin(group)

    def add_span(self, name: str, start: float, end: float) -> None:
        """Record a named span (``perf_counter`` seconds) that is not a schedule action."""
        self.events.append(TimelineEvent(self.rank, name, SPAN, start - self.t0, end - self.t0))

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the time spent in the ``with`` block as a span called ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_span(name, start, time.perf_counter())


def _common_origin(group: dist.ProcessGroup | None, samples: int = 8) -> tuple[float, float]:
    """Group rank 0's ``perf_counter()`` now, expressed in this rank's clock (see ``start``), and
    the estimate's error bound: rank 0 read its clock between this rank's send and receive, so
    the offset is off by at most half the round trip kept."""
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    root = dist.get_global_rank(group, 0) if group is not None else 0
    me = dist.get_rank(group)
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    dist.barrier(group=group)
    offset, error = 0.0, 0.0  # this rank's clock minus the root's, and how far off it may be
    if me == 0:
        for peer in range(1, dist.get_world_size(group)):
            peer_rank = dist.get_global_rank(group, peer) if group is not None else peer
            for _ in range(samples):
                dist.recv(buf, peer_rank, group=group)
                buf.fill_(time.perf_counter())
                dist.send(buf, peer_rank, group=group)
    else:
        best = float("inf")
        for _ in range(samples):
            sent = time.perf_counter()
            dist.send(buf, root, group=group)
            dist.recv(buf, root, group=group)
            back = time.perf_counter()
            if back - sent < best:
                best, offset = back - sent, (sent + back) / 2 - float(buf.item())
        error = best / 2
    origin = torch.tensor([time.perf_counter() if me == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(origin, root, group=group)
    return float(origin.item()) + offset, error


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
        return sorted(local, key=_order)
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
    return sorted((e for part in parts for e in (part or [])), key=_order)


def _order(event: TimelineEvent) -> tuple[float, int, float]:
    return (event.start, event.rank, event.end)


def events_from_simulation(
    simulated: SimulationResult | Iterable[TimedAction], unit: float = 1.0
) -> list[TimelineEvent]:
    """The simulator's planned timeline as events; one simulated time unit lasts ``unit`` seconds."""
    timeline = simulated.timeline if isinstance(simulated, SimulationResult) else simulated
    events = [TimelineEvent.of_action(t.rank, t.action, t.start * unit, t.end * unit) for t in timeline]
    return sorted(events, key=_order)


# ---------------------------------------------------------------------- Chrome trace


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
