"""Our engine against ``torch.distributed.pipelining`` on the same model, layout and micro-batches.

Both run in the same processes, alternating in rounds (ours then theirs, theirs then ours, ...) so
that machine noise hits both alike: the same stage modules (separate copies with equal weights), the same
whole batch split into the same micro-batches, mean-squared-error loss on the last stage, GPipe
1F1B, interleaved 1F1B with two stages per rank and zero-bubble ZB-H1 (``ScheduleGPipe`` /
``Schedule1F1B`` over a ``PipelineStage``, ``ScheduleInterleaved1F1B`` over two,
``ScheduleInterleavedZeroBubble`` over one, which is ZB-H1). Step time: median over
the steps after warm-up of the first rank's step (it starts each step first and ends it last);
the ratio is the median over rounds of each round's ours / theirs.
Gradients after one step of each engine are compared as a check that both do the same work.

Two workloads:

* ``compute``: a small MLP stack (Linear + GELU blocks) on CPU, p = 2 ranks, real arithmetic.
* ``tiny``: the same stack 32 wide: microseconds of arithmetic per action, so the step time is the
  engines' own per-action cost (Python, bookkeeping, communication calls), p = 2 ranks.
* ``fixed``: one fixed-time (sleeping) layer per stage, p = 4 ranks: only scheduling and
  communication differ.

Run: ``python benchmarks/vs_torch_pipelining.py`` (table) or ``--json``. Key ``ratio_vs_torch``:
our step time over theirs, per workload and schedule. Target: <= 0.95.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import emit_json, launch, median, print_table, warn_if_busy
from _stages import FixedTimeLayer, mlp_layers, sleep_overshoot
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from lightning_pipe.batches.microbatch import signature, split_microbatches
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.partition.balance import split_layers
from lightning_pipe.schedule.builders import build_schedule

TARGET = 0.95
TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    # torch's zero-bubble "ZB1P" over one stage per rank is ZB-H1: the same order as ours.
    "zb_h1": ScheduleInterleavedZeroBubble,
}
VIRTUAL = {"interleaved_1f1b": 2}  # stages per rank; one for the others
MULTI = {"interleaved_1f1b", "zb_h1"}  # torch schedules that take a list of stages


def _stage_layers(
    workload: str, rank: int, p: int, cfg: dict[str, Any], v: int
) -> dict[int, list[nn.Module]]:
    """This rank's stages (loop placement) and their layers; a rank's work is the same for every v."""
    stages = list(range(rank, p * v, p))
    if workload in ("compute", "tiny"):
        torch.manual_seed(0)  # every rank builds the same whole stack, then keeps its stages
        layers = mlp_layers(cfg["width"], cfg["depth"])
        n = p * v
        balance = [cfg["depth"] // n] * n
        balance[-1] += cfg["depth"] - sum(balance)
        split = split_layers(layers, balance)
        return {s: split[s] for s in stages}
    return {s: [FixedTimeLayer(cfg["forward_ms"] / 1e3 / v, cfg["backward_ms"] / 1e3 / v)] for s in stages}


def _batch(workload: str, cfg: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    width = cfg.get("width", 64)
    return torch.randn(cfg["batch"], width, generator=g), torch.randn(cfg["batch"], width, generator=g)


def worker(workload: str, kinds: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    m, first, last = cfg["microbatches"], rank == 0, rank == p - 1
    sleep_overshoot()  # calibrate before timing
    out: dict[str, Any] = {}
    for kind in kinds:
        v = VIRTUAL.get(kind, 1)
        base = _stage_layers(workload, rank, p, cfg, v)
        ours_stages = {s: copy.deepcopy(layers) for s, layers in base.items()}
        theirs_modules = {s: nn.Sequential(*copy.deepcopy(layers)) for s, layers in base.items()}
        executor = PipelineExecutor(ours_stages, p * v, list(range(p)), torch.device("cpu"))
        executor.receive_early = cfg.get("receive_early")
        schedule = build_schedule(kind, p * v, m, virtual_stages=v)
        torch_stages = [
            PipelineStage(module, s, p * v, torch.device("cpu")) for s, module in theirs_modules.items()
        ]
        theirs = TORCH_SCHEDULES[kind](
            torch_stages if kind in MULTI else torch_stages[0], n_microbatches=m, loss_fn=F.mse_loss
        )
        ours_params = [q for layers in ours_stages.values() for layer in layers for q in layer.parameters()]
        theirs_params = [q for module in theirs_modules.values() for q in module.parameters()]

        def run_ours(
            step: int,
            params: list[nn.Parameter] = ours_params,
            sch: Any = schedule,
            executor: PipelineExecutor = executor,
        ) -> None:
            x, y = _batch(workload, cfg, step)
            xs, ys = split_microbatches(x, m), split_microbatches(y, m)
            for q in params:
                q.grad = None
            executor.run(
                sch,
                rank,
                inputs=xs if first else None,
                head=(lambda o, i: F.mse_loss(o, ys[i])) if last else None,  # type: ignore[arg-type]
                signatures=[signature(t) for t in xs],
            )

        def run_theirs(step: int, params: list[nn.Parameter] = theirs_params, sch: Any = theirs) -> None:
            x, y = _batch(workload, cfg, step)
            for q in params:
                q.grad = None
            if first:
                sch.step(x)
            elif last:
                sch.step(target=y, losses=[])
            else:
                sch.step()

        # Same work: gradients after one step of each (step 0's batch) must agree.
        run_ours(0)
        run_theirs(0)
        diff = max(
            (a.grad - b.grad).abs().max().item()  # type: ignore[operator]
            for a, b in zip(ours_params, theirs_params, strict=True)
        )
        rounds: list[dict[str, list[float]]] = []
        for r in range(cfg["rounds"]):
            order = [("ours", run_ours), ("theirs", run_theirs)]
            times: dict[str, list[float]] = {"ours": [], "theirs": [], "ours_cpu": [], "theirs_cpu": []}
            for name, run in order if r % 2 == 0 else order[::-1]:
                dist.barrier()
                for k in range(cfg["warmup"] + cfg["steps"]):
                    start, cpu = time.perf_counter(), time.process_time()
                    run(k)
                    if k >= cfg["warmup"]:
                        times[name].append(time.perf_counter() - start)
                        times[f"{name}_cpu"].append(time.process_time() - cpu)
            rounds.append(times)
        out[kind] = {"rounds": rounds, "grad_diff": diff}
    return out


WORKLOADS: dict[str, dict[str, Any]] = {
    "compute": {
        "ranks": 2,
        "width": 512,
        "depth": 8,
        "batch": 256,
        "microbatches": 8,
        "warmup": 3,
        "steps": 8,
        "rounds": 6,
    },
    "tiny": {
        "ranks": 2,
        "width": 32,
        "depth": 4,
        "batch": 64,
        "microbatches": 8,
        "warmup": 5,
        "steps": 30,
        "rounds": 6,
    },
    "fixed": {
        "ranks": 4,
        "forward_ms": 10.0,
        "backward_ms": 20.0,
        "batch": 32,
        "microbatches": 8,
        "warmup": 2,
        "steps": 3,
        "rounds": 4,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])
    parser.add_argument(
        "--receives",
        choices=["auto", "early", "at-turn"],
        default="auto",
        help="when our executor posts receives (PipelineExecutor.receive_early; auto: the default)",
    )
    args = parser.parse_args()
    warn_if_busy()

    ratio: dict[str, dict[str, float]] = {}
    step_ms: dict[str, dict[str, dict[str, float]]] = {}
    grad_diff: dict[str, dict[str, float]] = {}
    ratio_rounds: dict[str, dict[str, list[float]]] = {}
    cpu_ms: dict[str, dict[str, dict[str, float]]] = {}
    rows = []
    for workload in args.workloads:
        early = {"auto": None, "early": True, "at-turn": False}[args.receives]
        cfg = dict(WORKLOADS[workload], receive_early=early)
        result = launch(worker, cfg["ranks"], workload, args.schedules, cfg)[0]
        ratio[workload], step_ms[workload], grad_diff[workload] = {}, {}, {}
        for kind in args.schedules:
            rounds = result[kind]["rounds"]
            ours = median([t for r in rounds for t in r["ours"]])
            theirs = median([t for r in rounds for t in r["theirs"]])
            # Machine noise drifts over seconds: compare within each round, then take the median.
            per_round = [median(r["ours"]) / median(r["theirs"]) for r in rounds]
            ratio_rounds.setdefault(workload, {})[kind] = per_round
            ratio[workload][kind] = median(per_round)
            # CPU time of the first rank per step (all its threads): the engines' own work, which
            # other processes on the machine disturb far less than wall time.
            cpu_ms.setdefault(workload, {})[kind] = {
                name: median([t for r in rounds for t in r[f"{name}_cpu"]]) * 1e3
                for name in ("ours", "theirs")
            }
            step_ms[workload][kind] = {"ours": ours * 1e3, "theirs": theirs * 1e3}
            grad_diff[workload][kind] = result[kind]["grad_diff"]
            rows.append(
                [
                    workload,
                    cfg["ranks"],
                    cfg["microbatches"],
                    kind,
                    ours * 1e3,
                    theirs * 1e3,
                    ratio[workload][kind],
                    cpu_ms[workload][kind]["ours"],
                    cpu_ms[workload][kind]["theirs"],
                ]
            )
    met = all(r <= TARGET for per in ratio.values() for r in per.values())
    if args.json:
        emit_json(
            {
                "benchmark": "vs_torch_pipelining",
                "torch": torch.__version__,
                "workloads": {w: WORKLOADS[w] for w in args.workloads},
                "ratio_vs_torch": ratio,
                "ratio_per_round": ratio_rounds,
                "cpu_ms_rank0": cpu_ms,
                "step_ms": step_ms,
                "grad_max_abs_diff": grad_diff,
                "target": TARGET,
                "target_met": met,
            }
        )
        return
    print(
        f"torch {torch.__version__}, gloo, median step time of the first rank; "
        "ratio: median of per-round ratios"
    )
    print_table(
        [
            "workload",
            "p",
            "m",
            "schedule",
            "ours ms",
            "torch ms",
            "ours / torch",
            "ours CPU ms",
            "torch CPU ms",
        ],
        rows,
    )
    worst = max(d for per in grad_diff.values() for d in per.values())
    print(f"max |grad ours - grad torch| after one step: {worst:.2e}")
    print(f"target: ours / torch <= {TARGET}: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
