"""Properties of the machine that bound what any pipeline engine can reach on it.

Three measurements, each independent of lightning_pipe, to read the other benchmarks against:

* ``parallel_slowdown``: time of a fixed matmul loop when 2 processes run it at once, over the
  time of one alone (1.0: two real cores; 2.0: the two "cores" share one).
* ``exchange_us``: one 1 KiB tensor each way between 2 gloo ranks in one ``batch_isend_irecv``
  (the pattern of 1F1B's steady state), posted by both at the same time after a 10 ms pause, as
  pipeline stages do: percentiles over many exchanges.
* ``first_op_after_idle_us``: a tiny tensor op (``x * w`` on 256 floats) right after a 10 ms
  sleep, against the same op back to back: the cost of waking up cold.

Run: ``python benchmarks/machine.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _launch import emit_json, launch, print_table, warn_if_busy


def _matmul_loop(queue: Any) -> None:
    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    start = time.perf_counter()
    for _ in range(300):
        a @ a
    queue.put(time.perf_counter() - start)


def parallel_slowdown() -> float:
    ctx = mp.get_context("spawn")
    timings: dict[int, list[float]] = {1: [], 2: []}
    for n in (1, 2, 1, 2):
        queue = ctx.Queue()
        procs = [ctx.Process(target=_matmul_loop, args=(queue,)) for _ in range(n)]
        for p in procs:
            p.start()
        timings[n] += [queue.get() for _ in procs]
        for p in procs:
            p.join()
    return statistics.median(timings[2]) / statistics.median(timings[1])


def _exchange_worker(n: int, pause: float) -> list[float]:
    peer = 1 - dist.get_rank()
    send, recv = torch.zeros(256), torch.zeros(256)
    times = []
    dist.barrier()
    for _ in range(n):
        time.sleep(pause)
        start = time.perf_counter()
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        )
        works[1].wait()
        times.append(time.perf_counter() - start)
        works[0].wait()
    return times


def _percentiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "p50": v[len(v) // 2] * 1e6,
        "p90": v[int(0.9 * (len(v) - 1))] * 1e6,
        "max": v[-1] * 1e6,
    }


def first_op_after_idle() -> dict[str, float]:
    torch.set_num_threads(1)
    x, w = torch.randn(256), torch.ones(1)
    out: dict[str, float] = {}
    for idle in (0.0, 0.01):
        times = []
        for _ in range(40):
            if idle:
                time.sleep(idle)
            start = time.perf_counter()
            x * w
            times.append(time.perf_counter() - start)
        out["after_10ms_sleep" if idle else "back_to_back"] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    warn_if_busy()
    slowdown = parallel_slowdown()
    ranks = launch(_exchange_worker, 2, 60, 0.01)
    exchange = _percentiles(ranks[0] + ranks[1])
    idle = first_op_after_idle()
    if args.json:
        emit_json(
            {
                "benchmark": "machine",
                "parallel_slowdown": slowdown,
                "exchange_us": exchange,
                "first_op_after_idle_us": idle,
            }
        )
        return
    print_table(
        ["measurement", "value"],
        [
            ["2 processes' matmul time / 1 process's", slowdown],
            ["1 KiB both-ways gloo exchange p50 (us)", exchange["p50"]],
            ["  p90 (us)", exchange["p90"]],
            ["  max (us)", exchange["max"]],
            ["tiny op back to back (us)", idle["back_to_back"]],
            ["tiny op after a 10 ms sleep (us)", idle["after_10ms_sleep"]],
        ],
    )


if __name__ == "__main__":
    main()
