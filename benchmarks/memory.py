"""Activation memory per stage: GPipe keeps every micro-batch alive, 1F1B at most p of them.

Four ranks (gloo), each stage a small block whose activations are large next to its weights
(``Linear(256, 256)``, ``SiLU``, ``Linear(256, 256)``, ``Tanh`` on micro-batches of 1024 rows, so
about 4 MiB saved per micro-batch and stage). For each schedule, in a fresh set of processes (peak
RSS never goes down): the executor's ``measure_activation_memory`` gives the peak bytes autograd
saved for the micro-batches alive at once (``StepResult.peak_activation_bytes``) and the peak number
of them (``peak_stashed``); ``resource.getrusage`` gives each rank's peak resident set size, and
its growth over the resident size just before the measured step (the first full step, after a
one-micro-batch warm-up: the allocator keeps freed memory, so only a first step shows its peak).

The check: 1F1B's measured peak on every stage is at most ``p`` micro-batches' worth, where one
micro-batch's worth is the measured peak of a one-micro-batch step on that stage.

Run: ``python benchmarks/memory.py`` (table) or ``--json`` (keys ``peak_activation_bytes`` and
``peak_rss_bytes``, per schedule, per stage).
"""

from __future__ import annotations

import argparse
import os
import resource
from typing import Any

import torch
import torch.distributed as dist
from _launch import emit_json, launch, print_table, warn_if_busy
from _stages import square_loss
from torch import nn

from lightning_pipe.batches.microbatch import signature
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.schedule.builders import build_schedule

WIDTH, ROWS = 256, 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _release_sends_after_each_exchange() -> None:
    """What-if (``--release-sends``): wait for each batch's sends right away instead of at the
    end of the step, to show how much of the RSS is send buffers the transport keeps alive."""
    from lightning_pipe.execution.p2p import P2PTransport

    exchange = P2PTransport.exchange

    def exchange_and_flush(self: P2PTransport, sends: Any, recvs: Any) -> None:
        exchange(self, sends, recvs)
        self.flush()

    P2PTransport.exchange = exchange_and_flush  # type: ignore[method-assign]


def _detach_stored_losses() -> None:
    """What-if (``--detach-losses``): keep only detached losses in ``StepResult.outputs``; the
    attached ones keep each micro-batch's autograd graph, and with it the last stage's received
    input and its gradient, alive until the step ends."""
    from lightning_pipe.execution.executor import PipelineExecutor

    forward = PipelineExecutor._forward

    def forward_and_detach(self: PipelineExecutor, s: int, i: int) -> None:
        forward(self, s, i)
        value = self._result.outputs.get(i)
        if isinstance(value, torch.Tensor):
            self._result.outputs[i] = value.detach()

    PipelineExecutor._forward = forward_and_detach  # type: ignore[method-assign]


def worker(kind: str, m: int, release_sends: bool = False, detach_losses: bool = False) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    if release_sends:
        _release_sends_after_each_exchange()
    if detach_losses:
        _detach_stored_losses()
    torch.manual_seed(rank)
    stage = [nn.Linear(WIDTH, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    executor = PipelineExecutor({rank: stage}, p, list(range(p)), torch.device("cpu"))
    executor.measure_activation_memory = True
    schedule = build_schedule(kind, p, m)
    inputs = [torch.randn(ROWS, WIDTH) for _ in range(m)]

    def step(sch: Any, xs: list[torch.Tensor]) -> Any:
        return executor.run(
            sch,
            rank,
            inputs=xs if rank == 0 else None,
            head=square_loss,
            signatures=[signature(x) for x in xs],
        )

    # Warm up (gloo connections, header cache) with a single micro-batch: the allocator keeps
    # freed memory, so a full warm-up step would leave the measured step nothing to grow into.
    # Its measured bytes are one micro-batch's worth (its saved activations plus the weights that
    # backward keeps), the unit of the check.
    one = step(build_schedule(kind, p, 1), inputs[:1])
    dist.barrier()
    before = _rss_now()
    result = step(schedule, inputs)
    return {
        "peak_activation_bytes": result.peak_activation_bytes,
        "one_microbatch_bytes": one.peak_activation_bytes,
        "peak_stashed": result.peak_stashed,
        "peak_rss_bytes": _peak_rss(),
        "rss_growth_bytes": _peak_rss() - before,
    }


def _mib(n: float) -> float:
    return n / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument(
        "--release-sends",
        action="store_true",
        help="what-if: release send buffers after each exchange (patches the transport in the workers)",
    )
    parser.add_argument(
        "--detach-losses",
        action="store_true",
        help="what-if: store detached losses in StepResult.outputs (patches the executor in the workers)",
    )
    args = parser.parse_args()
    warn_if_busy()
    p, m = args.stages, args.microbatches
    # glibc's mmap threshold adapts upwards once a large block is freed, after which freed
    # activations stay in the heap and RSS stops following live memory; pin it (children inherit).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    results = {
        kind: launch(worker, p, kind, m, args.release_sends, args.detach_losses) for kind in ("gpipe", "1f1b")
    }

    act = {k: [r["peak_activation_bytes"] for r in v] for k, v in results.items()}
    rss = {k: [r["peak_rss_bytes"] for r in v] for k, v in results.items()}
    growth = {k: [r["rss_growth_bytes"] for r in v] for k, v in results.items()}
    stashed = {k: [r["peak_stashed"] for r in v] for k, v in results.items()}
    # The unit is one micro-batch's measured bytes on the same stage (the warm-up step), never the
    # executor's count of live micro-batches: a leak or an extra stash raises the measured peak
    # and fails the check. One micro-batch's bytes include the weights backward keeps, which a
    # peak counts once, so p units are an upper bound that an extra micro-batch still exceeds
    # while a micro-batch's activations outweigh (p - 1) x those weights (here 4 MiB vs 1.5 MiB).
    one = {k: [r["one_microbatch_bytes"] for r in v] for k, v in results.items()}
    units = [act["1f1b"][s] / one["1f1b"][s] for s in range(p)]
    within = [u <= p + 1e-6 for u in units]
    if args.json:
        emit_json(
            {
                "benchmark": "memory",
                "stages": p,
                "microbatches": m,
                "release_sends": args.release_sends,
                "detach_losses": args.detach_losses,
                "peak_activation_bytes": act,
                "peak_stashed": stashed,
                "one_microbatch_bytes": one,
                "peak_rss_bytes": rss,
                "rss_growth_bytes": growth,
                "one_f_one_b_at_most_p_microbatches": all(within),
            }
        )
        return
    print(f"p={p} stages, m={m} micro-batches, {ROWS}x{WIDTH} float32 activations (MiB)")
    rows = []
    for s in range(p):
        rows.append(
            [
                s,
                stashed["gpipe"][s],
                stashed["1f1b"][s],
                _mib(act["gpipe"][s]),
                _mib(act["1f1b"][s]),
                units[s],
                _mib(growth["gpipe"][s]),
                _mib(growth["1f1b"][s]),
                _mib(rss["gpipe"][s]),
                _mib(rss["1f1b"][s]),
            ]
        )
    print_table(
        [
            "stage",
            "live mb gpipe",
            "live mb 1f1b",
            "act gpipe",
            "act 1f1b",
            "1f1b in mb",
            "RSS growth gpipe",
            "RSS growth 1f1b",
            "peak RSS gpipe",
            "peak RSS 1f1b",
        ],
        rows,
    )
    print(f"1F1B holds at most p={p} micro-batches' worth on every stage: {all(within)}")


if __name__ == "__main__":
    main()
