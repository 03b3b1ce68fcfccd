"""Data-parallel step time: our bucketed reducer against torch's DistributedDataParallel.

Two processes (gloo, one intra-op thread each) train the same model, 8 x Linear(1024) with ReLU,
batch 32 per rank, with the same bucket size, under our reducer, DDP with torch's defaults
(gradients copied into buckets) and DDP with ``gradient_as_bucket_view=True`` (no copy, like
ours). Each process times full steps (zero_grad, forward, backward with the overlapped all-reduce,
optimizer step) of the implementations in alternating blocks, so machine noise hits all alike,
and reports medians (a step counts when the slower rank finishes it). Prints a table, or one JSON
object with ``--json``; the figure to quote is ``ratio`` (ours / DDP; target <= 1.0, never above
1.05).

    python benchmarks/dp_vs_ddp.py [--steps 20] [--blocks 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pipe.data_parallel.reducer import GradientReducer

WIDTH, LAYERS, BATCH, BUCKET_MB = 1024, 8, 32, 25.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def _worker(rank: int, port: int, steps: int, blocks: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))

    ours = _model()
    ours_opt = torch.optim.SGD(ours.parameters(), lr=1e-3)
    reducer = GradientReducer(list(ours.parameters()), dist.group.WORLD, BUCKET_MB)

    def ours_step() -> None:
        ours_opt.zero_grad()
        reducer.attach()
        reducer.arm()  # one micro-batch, no accumulation: this backward is the last
        ours(x).pow(2).mean().backward()
        reducer.finish()
        ours_opt.step()

    def ddp_runner(**kwargs: bool) -> tuple[DistributedDataParallel, Callable[[], None]]:
        model = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_MB, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        return model, step

    ddp, ddp_step = ddp_runner()  # torch's defaults: gradients copied into the buckets
    ddp_view, ddp_view_step = ddp_runner(gradient_as_bucket_view=True)  # like ours: no copy
    runs = (("ours", ours_step), ("ddp", ddp_step), ("ddp_view", ddp_view_step))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _, step in runs:  # warm-up
        for _ in range(3):
            step()
    for _ in range(blocks):
        for name, step in runs:
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    # Same updates on the same data: the two models must still agree (a sanity check, not timing).
    same = all(
        torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-5)
        for a, b, c in zip(
            ours.parameters(), ddp.module.parameters(), ddp_view.module.parameters(), strict=True
        )
    )
    torch.save({"times": times, "same": same}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per implementation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, args.steps, args.blocks, out), nprocs=2, join=True)
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]
    # A step ends when the slower rank ends it: take the max over ranks, step by step.
    names = ("ours", "ddp", "ddp_view")
    per_step = {
        k: [max(r["times"][k][i] for r in results) for i in range(len(results[0]["times"][k]))] for k in names
    }
    ours_ms, ddp_ms, view_ms = (statistics.median(per_step[k]) * 1e3 for k in names)
    report = {
        "model": f"{LAYERS} x Linear({WIDTH}) + ReLU, batch {BATCH} per rank, dp=2, gloo, 1 thread per rank",
        "bucket_cap_mb": BUCKET_MB,
        "steps_timed": len(per_step["ours"]),
        "ours_ms": round(ours_ms, 2),
        "ddp_ms": round(ddp_ms, 2),
        "ddp_bucket_view_ms": round(view_ms, 2),
        "ratio": round(ours_ms / ddp_ms, 3),
        "ratio_vs_bucket_view": round(ours_ms / view_ms, 3),
        "same_weights": all(r["same"] for r in results),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['model']}, bucket {BUCKET_MB} MB, median of {report['steps_timed']} steps")
    print(f"{'implementation':<24}{'step (ms)':>12}")
    print(f"{'lightning_pipe reducer':<24}{ours_ms:>12.2f}")
    print(f"{'DistributedDataParallel':<24}{ddp_ms:>12.2f}")
    print(f"{'DDP, bucket view':<24}{view_ms:>12.2f}   (gradient_as_bucket_view=True)")
    print(f"{'ratio ours / DDP':<24}{report['ratio']:>12.3f}   (target <= 1.0, never above 1.05)")
    print(f"{'ratio ours / DDP view':<24}{report['ratio_vs_bucket_view']:>12.3f}")
    print(f"same weights after the run: {report['same_weights']}")


if __name__ == "__main__":
    main()
