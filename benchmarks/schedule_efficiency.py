"""How close the engine gets to a schedule's ideal step time, with stages of known cost.

Four ranks (gloo, one process each), each rank's work one :class:`FixedTimeLayer` taking exactly
``t_f`` forward and ``t_b`` backward (interleaved 1F1B: ``v`` stages per rank of ``t_f / v`` and
``t_b / v``; zero-bubble: the backward's two halves, input and weight gradient, as separate
actions). The ideal is the schedule's simulated makespan with those times: with equal stages
``(m + p - 1)(t_f + t_b)`` for GPipe and 1F1B, ``(v m + p - 1)(t_f + t_b) / v`` for interleaved
1F1B when p divides m, ``m (t_f + t_b) + (p - 1) t_f`` for ZB-H1 when m >= p. Efficiency is the
measured step time over it (1.0 is ideal, lower is impossible).
Step time: median over back-to-back steps after warm-up of the first rank's ``executor.run``
(that rank starts each step first and finishes it last).

Run: ``python benchmarks/schedule_efficiency.py`` (table) or ``--json`` (one JSON object);
``--timeline DIR`` also writes each configuration's recorded timeline as PNG and Chrome trace;
``--pair-receives`` times every configuration twice, step by step alternately: receives posted
one exchange early ("step ms") and at their turn (the executor's ``receive_early`` True / False;
without the flag, its default), and prints the ratio (key ``early_over_at_turn``).
Target: efficiency <= 1.02 at m = 16.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _launch import emit_json, launch, median, print_table, warn_if_busy
from _stages import FixedTimeLayer, square_loss

from lightning_pipe.batches.microbatch import signature
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.execution.timeline import TimelineRecorder, gather_timeline
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.schedule.simulate import simulate

TARGET = 1.02


def _virtual(kind: str, v: int) -> int:
    return v if kind == "interleaved_1f1b" else 1


def worker(
    kinds: list[str], ms: list[int], tf: float, tb: float, warmup: int, steps: int, v: int, pair: bool
) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for kind in kinds:
        # A rank's work is the same for every schedule: interleaved splits it into v stages.
        per_rank = _virtual(kind, v)
        stages = {s: [FixedTimeLayer(tf / per_rank, tb / per_rank)] for s in range(rank, p * per_rank, p)}
        executor = PipelineExecutor(stages, p * per_rank, list(range(p)), torch.device("cpu"))
        for m in ms:
            schedule = build_schedule(kind, p * per_rank, m, virtual_stages=per_rank)
            inputs = [torch.randn(4, 64) for _ in range(m)]
            sigs = [signature(x) for x in inputs]

            def step(
                inputs: list[torch.Tensor] = inputs,
                sigs: list[Any] = sigs,
                sch: Any = schedule,
                executor: PipelineExecutor = executor,
                recorder: TimelineRecorder | None = None,
            ) -> None:
                executor.run(
                    sch,
                    rank,
                    inputs=inputs if rank == 0 else None,
                    head=square_loss,
                    signatures=sigs,
                    recorder=recorder,
                )

            dist.barrier()
            # Receives posted one exchange early and, with pair, at their turn: step by step
            # alternately, so that machine noise hits both alike (the executor's default, "auto",
            # is early for interleaved and zero-bubble schedules only).
            durations: dict[str, list[float]] = {"early": [], "at_turn": [], "default": []}
            for k in range(warmup + steps):
                for mode in ("early", "at_turn") if pair else ("default",):
                    executor.receive_early = {"early": True, "at_turn": False}.get(mode)
                    start = time.perf_counter()
                    step()
                    if k >= warmup:
                        durations[mode].append(time.perf_counter() - start)
            executor.receive_early = None
            # One more step, recorded, for the timeline and the actual compute times.
            recorder = TimelineRecorder()
            recorder.start()
            step(recorder=recorder)
            events = gather_timeline(recorder)
            out[f"{kind}/{m}"] = {"durations": durations, "events": events}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])
    parser.add_argument("--virtual-stages", type=int, default=2, help="stages per rank (interleaved)")
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeline", type=Path, help="write recorded timelines (PNG, trace) here")
    parser.add_argument(
        "--pair-receives",
        action="store_true",
        help="also time each configuration with receives posted at their turn (not early), alternating",
    )
    args = parser.parse_args()
    warn_if_busy()
    tf, tb, p = args.forward_ms / 1e3, args.backward_ms / 1e3, args.stages
    v = args.virtual_stages
    results = launch(
        worker, p, args.schedules, args.microbatches, tf, tb, args.warmup, args.steps, v, args.pair_receives
    )

    rows, efficiency, step_ms, compute_ms = [], {}, {}, {}
    early_ratio: dict[str, float] = {}
    for kind in args.schedules:
        for m in args.microbatches:
            key = f"{kind}/{m}"
            timed = results[0][key]["durations"]
            at_turn = timed["at_turn"]
            measured = median(timed["early"] if at_turn else timed["default"])
            k = _virtual(kind, v)
            schedule = build_schedule(kind, p * k, m, virtual_stages=k)
            plan = simulate(schedule, tf / k, tb / k)
            ideal = plan.makespan
            events = results[0][key]["events"]
            fwd = median([e.duration for e in events if e.kind == "F"])
            # A rank's backward: one B, or (zero-bubble) its I and W halves.
            if any(e.kind == "I" for e in events):
                bwd = median([e.duration for e in events if e.kind == "I"]) + median(
                    [e.duration for e in events if e.kind == "W"]
                )
            else:
                bwd = median([e.duration for e in events if e.kind == "B"])
            actual_ideal = simulate(schedule, fwd, bwd).makespan
            efficiency[key] = measured / ideal
            step_ms[key] = measured * 1e3
            compute_ms[key] = {"forward": fwd * 1e3, "backward": bwd * 1e3}
            rows.append(
                [
                    kind,
                    m,
                    ideal * 1e3,
                    measured * 1e3,
                    measured / ideal,
                    measured / actual_ideal,
                    plan.bubble_fraction,
                ]
                + ([median(at_turn) * 1e3, measured / median(at_turn)] if at_turn else [])
            )
            if at_turn:
                early_ratio[key] = measured / median(at_turn)
            if args.timeline is not None:
                from lightning_pipe.schedule.timeline_export import plot_timeline, write_chrome_trace

                write_chrome_trace(events, args.timeline / f"{kind}_m{m}.json")
                plot_timeline(
                    events, args.timeline / f"{kind}_m{m}.png", title=f"{kind} recorded, p={p}, m={m}"
                )

    at16 = [v for k, v in efficiency.items() if k.endswith("/16")]
    met = all(v <= TARGET for v in at16) if at16 else None
    if args.json:
        emit_json(
            {
                "benchmark": "schedule_efficiency",
                "stages": p,
                "forward_ms": args.forward_ms,
                "backward_ms": args.backward_ms,
                "efficiency": efficiency,
                "step_ms": step_ms,
                "measured_compute_ms": compute_ms,
                "early_over_at_turn": early_ratio,
                "target": TARGET,
                "target_met_at_m16": met,
            }
        )
        return
    print(
        f"p={p} ranks (gloo), t_f={args.forward_ms} ms, t_b={args.backward_ms} ms, "
        f"median of {args.steps} steps"
    )
    print_table(
        ["schedule", "m", "ideal ms", "step ms", "efficiency", "vs actual F/B", "bubble (plan)"]
        + (["step ms, receives at turn", "early / at turn"] if args.pair_receives else []),
        rows,
    )
    if met is not None:
        print(f"target: efficiency <= {TARGET} at m=16: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
