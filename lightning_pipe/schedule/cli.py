"""``python -m lightning_pipe.schedule``: look at a pipeline schedule before running it.

Builds the schedule, prints its text rendering and what the simulator says it costs (makespan,
bubble fraction, peak micro-batches in flight per stage), and optionally writes the *planned*
timeline as a PNG (``--png``) and as a Chrome trace (``--trace``, for https://ui.perfetto.dev).
Nothing is launched: no process group, no model.

Example::

    python -m lightning_pipe.schedule --schedule 1f1b --stages 4 --microbatches 8 \\
        --forward-time 1 --backward-time 2 --png 1f1b.png --trace 1f1b.json

Times are per stage and per micro-batch, in milliseconds (only the PNG's axis and the trace's
timestamps depend on the unit; the bubble fraction does not).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_pipe.schedule.actions import Action, ActionType
from lightning_pipe.schedule.builders import ScheduleKind, build_schedule
from lightning_pipe.schedule.render import render_schedule
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.timeline import events_from_simulation
from lightning_pipe.schedule.timeline_export import plot_timeline, write_chrome_trace

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_pipe.schedule",
        description="Render and simulate a pipeline schedule; write its planned timeline.",
    )
    p.add_argument("--schedule", default="1f1b", choices=[k.value for k in ScheduleKind])
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks (one stage each unless interleaved)")
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="stages per rank for interleaved_1f1b (default 2); times are then per rank's whole work",
    )
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per batch")
    p.add_argument("--forward-time", type=float, default=1.0, help="forward time per stage (ms)")
    p.add_argument("--backward-time", type=float, default=2.0, help="backward time per stage (ms)")
    p.add_argument("--comm-time", type=float, default=0.0, help="time of one exchange (ms)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="print one line per schedule instead (bubble, makespan, peak activations per rank)",
    )
    p.add_argument(
        "--skips",
        default="",
        help="skip connections between stages as producer:consumer pairs, e.g. 0:3,1:2 (a U-Net)",
    )
    p.add_argument("--png", help="write the planned timeline as a PNG here (needs matplotlib)")
    p.add_argument("--trace", help="write the planned timeline as a Chrome trace JSON here")
    return p


def _most_ahead(actions: Sequence[Action]) -> int:
    ahead = most = 0
    for action in actions:
        if action.kind is ActionType.FORWARD:
            ahead += 1
            most = max(most, ahead)
        elif action.kind in (ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT):
            ahead -= 1
    return most


def compare(p: int, m: int, tf: float, tb: float, comm: float, v: int) -> str:
    """Every schedule for ``p`` ranks and ``m`` micro-batches, one line each: simulated bubble and
    makespan, and the most micro-batches of a whole rank's activations alive on each rank."""
    lines = [f"{p} ranks, {m} micro-batches; a rank's work: forward {tf:g}, backward {tb:g} ms"]
    lines.append(f"{'schedule':>22}  {'bubble':>7}  {'makespan':>9}  peak activations per rank")
    for kind in ScheduleKind:
        k = v if kind is ScheduleKind.INTERLEAVED_1F1B else 1
        schedule = build_schedule(kind, p * k, m, virtual_stages=k)
        result = simulate(schedule, tf / k, tb / k, comm)
        # Micro-batches whose activations a rank holds at once (forwards run, backwards not yet),
        # each counting 1/k: a stage of an interleaved rank holds 1/k of the rank's layers.
        per_rank = [_most_ahead(schedule.actions[r]) / k for r in range(p)]
        name = kind.value if k == 1 else f"{kind.value} (v={k})"
        peaks = " ".join(f"{x:g}" for x in per_rank)
        lines.append(f"{name:>22}  {result.bubble_fraction:7.1%}  {result.makespan:9g}  {peaks}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tf, tb = args.forward_time, args.backward_time
    if tf <= 0 or tb <= 0 or args.comm_time < 0:
        parser().error("--forward-time and --backward-time must be > 0 and --comm-time >= 0")
    if args.compare:
        print(compare(args.stages, args.microbatches, tf, tb, args.comm_time, args.virtual_stages or 2))
        return 0
    v = args.virtual_stages or (2 if args.schedule == ScheduleKind.INTERLEAVED_1F1B.value else 1)
    try:
        skips = [tuple(int(k) for k in pair.split(":")) for pair in args.skips.split(",") if pair]
        if any(len(pair) != 2 for pair in skips):
            raise ValueError(f"--skips takes producer:consumer pairs (0:3,1:2), got {args.skips!r}")
        schedule = build_schedule(
            args.schedule,
            args.stages * v,
            args.microbatches,
            virtual_stages=v,
            skips=skips,  # type: ignore[arg-type]
        )
    except ValueError as err:
        parser().error(str(err))
    tf, tb = tf / v, tb / v  # a rank's v stages together do one stage's work of the other schedules
    integral = float(tf).is_integer() and float(tb).is_integer()
    # The text grid needs whole cells; with fractional times it shows the order at unit times.
    if integral:
        print(render_schedule(schedule, int(tf), int(tb)))
    else:
        print(render_schedule(schedule))
        print("(drawn with unit times: the grid needs whole cells)")
    result = simulate(schedule, tf, tb, args.comm_time)
    p, m = args.stages, args.microbatches
    print()
    print(f"simulated: forward {tf:g} ms, backward {tb:g} ms, exchange {args.comm_time:g} ms per stage")
    if schedule.splits_backward:
        # ZB-H1 with I and W each half of the backward: the bubble is (p - 1)(t_f + t_I - t_W).
        ti = tw = tb / 2
        ideal = max(m * (tf + tb) + (p - 1) * (tf + ti - tw), (m + p - 1) * (tf + ti) + tw)
        print(
            f"  makespan   {result.makespan:g} ms  (max(m (tf + tb) + (p - 1)(tf + tI - tW), "
            f"(m + p - 1)(tf + tI) + tW) = {ideal:g} ms, tI = tW = tb / 2)"
        )
        bubble = 1 - m * (tf + tb) / ideal
        print(f"  bubble     {result.bubble_fraction:.1%}  (1 - m (tf + tb) / that makespan = {bubble:.1%})")
    else:
        ideal = (v * m + p - 1) * (tf + tb)
        print(f"  makespan   {result.makespan:g} ms  ((v m + p - 1) x (tf + tb) = {ideal:g} ms, v = {v})")
        bubble = (p - 1) / (v * m + p - 1)
        print(f"  bubble     {result.bubble_fraction:.1%}  ((p - 1) / (v m + p - 1) = {bubble:.1%})")
    peaks = "  ".join(f"stage {s}: {n}" for s, n in enumerate(result.peak_inflight))
    per = " (a stage is 1/v of a rank's layers; --compare gives it per rank)" if v > 1 else ""
    print(f"  peak micro-batches in flight per stage{per}  {peaks}")
    events = events_from_simulation(result, unit=1e-3)
    title = f"{schedule.name} planned: {schedule.num_stages} stages on {p} ranks, {m} micro-batches"
    if args.trace:
        path = write_chrome_trace(events, args.trace, name=title)
        print(f"wrote {path} (Chrome trace: open in https://ui.perfetto.dev)")
    if args.png:
        plot_timeline(events, args.png, title=title)
        print(f"wrote {args.png}")
    return 0
