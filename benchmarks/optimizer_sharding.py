"""Optimizer-state sharding (ZeRO-1, ``shard_optimizer_state=True``) against replicated state.

Two data-parallel processes (gloo, one intra-op thread each) train 8 x Linear(1024) + ReLU with
Adam, batch 32 per rank, through the engine's own pieces: the bucketed
:class:`~lightning_pipe.data_parallel.reducer.GradientReducer` (all-reduce, or reduce-scatter when
sharded) and :class:`~lightning_pipe.data_parallel.sharded_optimizer.ShardedOptimizer`.

* Step time (zero_grad, forward, backward with the overlapped reduction, step, and, sharded, the
  parameters' all-gather): the set-ups live in the same processes and alternate in blocks, so
  machine noise hits them alike. ``sharded`` overlaps the gather with the next forward (the
  default, ``overlap_param_gather=True``); ``sharded-blocking`` waits for it in the step.
  ``step_ratio`` is sharded over replicated (goal <= 1.05), under the quoted protocol:

  - ``consecutive`` (quoted): one barrier per block, then ``--steps`` steps back to back timed
    together, the wait for the last step's gathers inside the window; a step is the block's
    time over ``--steps``, the block's time the slower rank's.
  - ``barrier`` (the protocol of earlier versions, for comparison): an untimed barrier before
    every step. gloo's barrier waits for the work queued before it, so an overlapped gather
    finishes *outside* the timed window there: this protocol flatters the overlap.
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


SETUPS = ("replicated", "sharded", "sharded-blocking")


def _setup(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, GradientReducer, ShardedOptimizer | None]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    shard = mode != "replicated"
    reducer = GradientReducer(list(model.parameters()), dist.group.WORLD, BUCKET_MB, shard=shard)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if not shard:
        return model, optimizer, reducer, None
    sharded = ShardedOptimizer(optimizer, reducer.layout(), overlap=mode == "sharded")
    sharded.gather.watch(list(model))  # as the strategy does for its pipeline layers
    return model, optimizer, reducer, sharded


PHASES = ("zero_grad+attach", "forward", "of which gather waits", "backward", "finish", "step")


def _step(
    model: nn.Module,
    optimizer: Any,
    reducer: GradientReducer,
    sharded: Any,
    x: torch.Tensor,
    phases: dict[str, list[float]] | None = None,
) -> None:
    marks = [time.perf_counter()]
    optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    reducer.attach()
    reducer.arm()  # one micro-batch: this backward is the window's last
    marks.append(time.perf_counter())
    loss = model(x).pow(2).mean()  # overlapped: each layer first waits for its buckets' gathers
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    reducer.finish()
    if sharded is not None:
        sharded.attach_gradients(reducer.used)
    marks.append(time.perf_counter())
    optimizer.step()  # sharded: its post-hook launches the parameters' all-gathers
    marks.append(time.perf_counter())
    if phases is not None:
        timed = ("zero_grad+attach", "forward", "backward", "finish", "step")
        for name, start, stop in zip(timed, marks[:-1], marks[1:], strict=True):
            phases[name].append(stop - start)


def _timing_waits(sharded: ShardedOptimizer) -> list[float]:
    """Time the waits for the gathers (``--profile``) into the returned cell: the benchmark wraps
    the gather's ``wait``; the library keeps no timings."""
    gather, waited = sharded.gather, [0.0]
    wait = gather.wait

    def timed(buckets: Any) -> None:
        start = time.perf_counter()
        wait(buckets)
        waited[0] += time.perf_counter() - start

    gather.wait = timed  # type: ignore[method-assign]
    return waited


def _settle(sharded: ShardedOptimizer | None) -> None:
    """Wait for the last step's gathers (what a next forward would wait for)."""
    if sharded is not None:
        sharded.gather.wait_all()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def timing_worker(steps: int, blocks: int, profile: bool = False) -> dict[str, Any]:
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    setups = {name: _setup(name) for name in SETUPS}
    phases: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in SETUPS}
    waited = {
        name: _timing_waits(s[3]) if profile and s[3] is not None else [0.0] for name, s in setups.items()
    }
    consecutive: dict[str, list[float]] = {name: [] for name in setups}
    barrier: dict[str, list[float]] = {name: [] for name in setups}
    for block in range(blocks):
        order = list(setups) if block % 2 == 0 else list(setups)[::-1]
        for name in order:
            setup = setups[name]
            for _ in range(2):  # warm-up
                _step(*setup, x)
            _settle(setup[3])
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                waited[name][0] = 0.0
                _step(*setup, x, phases[name] if profile else None)
                phases[name]["of which gather waits"].append(waited[name][0])
            _settle(setup[3])  # inside the window: the last step's gathers are part of its cost
            consecutive[name].append((time.perf_counter() - start) / steps)
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                _step(*setup, x)
                barrier[name].append(time.perf_counter() - start)
            _settle(setup[3])
    # Same work: every set-up ends with the same weights.
    weights = {n: list(setups[n][0].parameters()) for n in setups}
    diff = max(
        (p - q).abs().max().item()
        for n in ("sharded", "sharded-blocking")
        for p, q in zip(weights["replicated"], weights[n], strict=True)
    )
    return {"consecutive": consecutive, "barrier": barrier, "weight_diff": diff, "phases": phases}


def memory_worker(shard: bool, steps: int) -> dict[str, Any]:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: big buffers come and go
    setup = _setup("sharded" if shard else "replicated")
    x = torch.randn(BATCH, WIDTH)
    for _ in range(steps):
        _step(*setup, x)
    _settle(setup[3])
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
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument(
        "--profile", action="store_true", help="also print where a step's time goes (consecutive steps)"
    )
    args = parser.parse_args()
    warn_if_busy()
    dp = 2
    timed = launch(timing_worker, dp, args.steps, args.blocks, args.profile)
    memory = {name: launch(memory_worker, dp, name == "sharded", 3) for name in ("replicated", "sharded")}
    # A step (or block) counts when the slower rank finishes it.
    step = {
        protocol: {
            name: median(
                [max(r[protocol][name][k] for r in timed) for k in range(len(timed[0][protocol][name]))]
            )
            for name in SETUPS
        }
        for protocol in ("consecutive", "barrier")
    }
    ratios = {
        protocol: {name: step[protocol][name] / step[protocol]["replicated"] for name in SETUPS}
        for protocol in step
    }
    ratio = ratios["consecutive"]["sharded"]
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
                "protocol": "consecutive",
                "step_ms": {k: v * 1e3 for k, v in step["consecutive"].items()},
                "step_ratio": ratio,
                "step_ratio_blocking_gather": ratios["consecutive"]["sharded-blocking"],
                "barrier_protocol": {
                    "step_ms": {k: v * 1e3 for k, v in step["barrier"].items()},
                    "step_ratio": ratios["barrier"]["sharded"],
                    "step_ratio_blocking_gather": ratios["barrier"]["sharded-blocking"],
                },
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
        ["set-up", "step ms", "ratio", "step ms (barrier)", "ratio (barrier)"],
        [
            [name, *(v for p in ("consecutive", "barrier") for v in (step[p][name] * 1e3, ratios[p][name]))]
            for name in SETUPS
        ],
    )
    print_table(
        ["optimizer state", "state MiB per rank", "peak RSS MiB per rank"],
        [[name, state[name] / mib, rss[name] / mib] for name in ("replicated", "sharded")],
    )
    verdict = "met" if met["step_ratio"] else "MISSED"
    print(f"sharded / replicated step time (consecutive steps): {ratio:.3f} (goal <= 1.05: {verdict})")
    print(
        f"sharded state {state['sharded'] / mib:.2f} MiB <= 1/{dp} of replicated + one bucket "
        f"({bound / mib:.2f} MiB): {'met' if met['state'] else 'MISSED'}"
    )
    diff = max(r["weight_diff"] for r in timed)
    print(f"weights after the timed steps, sharded vs replicated: max |diff| {diff:.2e}")
    if args.profile:  # per rank: the median of each phase over the consecutive steps, in ms
        print("where a step's time goes (ms, median over the consecutive steps, rank 0 / rank 1):")
        print_table(
            ["phase", *SETUPS],
            [
                [
                    phase,
                    *(
                        " / ".join(f"{median(r['phases'][n][phase]) * 1e3:.2f}" for r in timed)
                        for n in SETUPS
                    ),
                ]
                for phase in PHASES
            ],
        )


if __name__ == "__main__":
    main()
