"""Optimizer-state sharding (ZeRO-1, ``shard_optimizer_state=True``) against replicated state.

Two data-parallel processes (gloo, one intra-op thread each) train 8 x Linear(1024) + ReLU with
Adam, batch 32 per rank, through the engine's own pieces: the bucketed
:class:`~lightning_pipe.data_parallel.reducer.GradientReducer` (all-reduce, or reduce-scatter when
sharded) and :class:`~lightning_pipe.data_parallel.sharded_optimizer.ShardedOptimizer`.

* Step time (zero_grad, forward, backward with the overlapped reduction, step, and, sharded, the
  parameters' all-gather): both set-ups live in the same processes and alternate in blocks, so
  machine noise hits both alike; ``step_ratio`` is sharded over replicated (goal <= 1.05).
* Optimizer-state bytes per rank, and peak RSS per rank: each set-up alone in fresh processes
  (peak RSS only grows), glibc's mmap threshold pinned so that RSS follows live memory. The goal
  for the state is at most 1/dp of the replicated state plus one bucket.

Run: ``python benchmarks/optimizer_sharding.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from _launch import emit_json, launch, median, print_table, warn_if_busy
from torch import nn

from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.sharded_optimizer import ShardedOptimizer

WIDTH, LAYERS, BATCH, BUCKET_MB = 1024, 8, 32, 25.0


def _setup(shard: bool) -> tuple[nn.Module, torch.optim.Optimizer, GradientReducer, ShardedOptimizer | None]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    reducer = GradientReducer(list(model.parameters()), dist.group.WORLD, BUCKET_MB, shard=shard)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer, reducer, ShardedOptimizer(optimizer, reducer.layout()) if shard else None


def _step(model: nn.Module, optimizer: Any, reducer: GradientReducer, sharded: Any, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    reducer.attach()
    reducer.arm()  # one micro-batch: this backward is the window's last
    model(x).pow(2).mean().backward()
    reducer.finish()
    if sharded is not None:
        sharded.attach_gradients(reducer.used)
    optimizer.step()  # sharded: its post-hook all-gathers the parameters


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def timing_worker(steps: int, blocks: int) -> dict[str, Any]:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    setups = {"replicated": _setup(False), "sharded": _setup(True)}
    times: dict[str, list[float]] = {name: [] for name in setups}
    for block in range(blocks):
        order = list(setups) if block % 2 == 0 else list(setups)[::-1]
        for name in order:
            for k in range(steps + 2):
                dist.barrier()
                start = time.perf_counter()
                _step(*setups[name], x)
                if k >= 2:
                    times[name].append(time.perf_counter() - start)
    # Same work: both set-ups end with the same weights.
    a, b = (list(setups[n][0].parameters()) for n in setups)
    diff = max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))
    return {"times": times, "weight_diff": diff}


def memory_worker(shard: bool, steps: int) -> dict[str, Any]:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: big buffers come and go
    setup = _setup(shard)
    x = torch.randn(BATCH, WIDTH)
    for _ in range(steps):
        _step(*setup, x)
    return {
        "state_bytes": _state_bytes(setup[1]),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "largest_bucket_bytes": max(
            sum(p.numel() * p.element_size() for p, _ in b.params) for b in setup[2].layout().buckets
        )
        if shard
        else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    warn_if_busy()
    dp = 2
    timed = launch(timing_worker, dp, args.steps, args.blocks)
    memory = {name: launch(memory_worker, dp, name == "sharded", 3) for name in ("replicated", "sharded")}
    # A step counts when the slower rank finishes it.
    step = {
        name: median([max(r["times"][name][k] for r in timed) for k in range(len(timed[0]["times"][name]))])
        for name in ("replicated", "sharded")
    }
    ratio = step["sharded"] / step["replicated"]
    state = {name: max(r["state_bytes"] for r in memory[name]) for name in memory}
    rss = {name: max(r["peak_rss"] for r in memory[name]) for name in memory}
    bucket = memory["sharded"][0]["largest_bucket_bytes"]
    bound = state["replicated"] / dp + bucket
    met = {"step_ratio": ratio <= 1.05, "state": state["sharded"] <= bound}
    if args.json:
        emit_json(
            {
                "benchmark": "optimizer_sharding",
                "dp": dp,
                "step_ms": {k: v * 1e3 for k, v in step.items()},
                "step_ratio": ratio,
                "optimizer_state_bytes_per_rank": state,
                "peak_rss_bytes_per_rank": rss,
                "state_bound_bytes": bound,
                "weight_max_abs_diff": max(r["weight_diff"] for r in timed),
                "targets_met": met,
            }
        )
        return
    mib = 1024 * 1024
    print(f"dp={dp} (gloo), {LAYERS} x Linear({WIDTH}), Adam, batch {BATCH} per rank, buckets {BUCKET_MB} MB")
    print_table(
        ["optimizer state", "step ms", "state MiB per rank", "peak RSS MiB per rank"],
        [[name, step[name] * 1e3, state[name] / mib, rss[name] / mib] for name in ("replicated", "sharded")],
    )
    verdict = "met" if met["step_ratio"] else "MISSED"
    print(f"sharded / replicated step time: {ratio:.3f} (goal <= 1.05: {verdict})")
    print(
        f"sharded state {state['sharded'] / mib:.2f} MiB <= 1/{dp} of replicated + one bucket "
        f"({bound / mib:.2f} MiB): {'met' if met['state'] else 'MISSED'}"
    )
    diff = max(r["weight_diff"] for r in timed)
    print(f"weights after the timed steps, sharded vs replicated: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
