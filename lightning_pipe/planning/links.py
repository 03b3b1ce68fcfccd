"""Probe the links of a real process group: point-to-point and all-reduce, latency and bandwidth.

A layout's communication costs depend on the machine more than on anything else the planner
sees (NVLink against PCIe, a node's shared memory against the network, gloo on CPU cores that
also compute), so they are measured where the run will happen, in its own process group, in a
fraction of a second:

* point-to-point between the group's first two ranks, as pipeline neighbours talk: a ping-pong of
  a small and a large message, each one-way time half a round trip;
* all-reduce over the whole group, of the same two sizes, read as a ring: ``2 (n - 1)`` steps of
  latency and ``2 (n - 1) / n`` of the bytes through each link;
* reduce-scatter and all-gather (ZeRO-1's and FSDP2's collectives), the same way with ``n - 1``
  steps, each measured apart: a backend need not run them as half a ring all-reduce (gloo on CPU
  took as long for a reduce-scatter as for an all-reduce of the same bytes, and 3x half an
  all-reduce's time for small messages, on this project's 4 processes), so the cost model would
  otherwise predict ZeRO-1 and FSDP2 rows short.

From two sizes, the small one's time is (nearly) the latency and the difference gives the
bandwidth. Every rank times its own part, then takes global rank 0's numbers (broadcast), so that
every rank goes on to the same decision.

What processes of one host pay for sharing its cores is probed apart, in :mod:`.cores`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from statistics import median, median_high
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.collectives import all_gather_flat, reduce_scatter_flat
from lightning_pipe.planning.costs import Links

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 8 * 1024 * 1024
"""The two message sizes: a few kilobytes (latency) and several megabytes (a bucket's size)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    run()  # warm-up: connections, allocations
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return median_high(times)


def _fit(small: float, large: float, units: float) -> tuple[float, float]:
    """``(latency, bandwidth)`` from times for :data:`SMALL_BYTES` and :data:`LARGE_BYTES`, each
    moving ``units`` times those bytes through a link. Noise that makes the large message as fast
    as the small one leaves the bandwidth at what the large message alone shows."""
    extra = (LARGE_BYTES - SMALL_BYTES) * units
    bandwidth = extra / (large - small) if large > small else LARGE_BYTES * units / max(large, 1e-9)
    return max(small - SMALL_BYTES * units / bandwidth, 0.0), bandwidth


def probe_links(device: torch.device, group: dist.ProcessGroup | None = None, repeats: int = 5) -> Links:
    """The links of ``group`` (default: the world), the same on every rank; collective: every
    rank of the group calls it. Data-parallel communication counts as overlapped on CUDA (its own
    streams) and not on CPU (gloo works on the cores that compute)."""
    ranks = dist.get_world_size(group)
    me = dist.get_rank(group)
    numbers = torch.zeros(8, dtype=torch.float64)
    times: dict[tuple[str, int], float] = {}
    for nbytes in (SMALL_BYTES, LARGE_BYTES):
        buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        if ranks > 1 and me < 2:
            peer = dist.get_global_rank(group, 1 - me) if group is not None else 1 - me

            def ping_pong(buffer: torch.Tensor = buffer, peer: int = peer) -> None:
                if me == 0:
                    dist.send(buffer, peer, group=group)
                    dist.recv(buffer, peer, group=group)
                else:
                    dist.recv(buffer, peer, group=group)
                    dist.send(buffer, peer, group=group)

            times[("p2p", nbytes)] = _median_seconds(ping_pong, device, repeats) / 2

        def reduce(buffer: torch.Tensor = buffer) -> None:
            dist.all_reduce(buffer, group=group)

        times[("all_reduce", nbytes)] = _median_seconds(reduce, device, repeats)
        if ranks > 1:
            shard = torch.zeros(nbytes // 4 // ranks, dtype=torch.float32, device=device)
            whole = buffer[: shard.numel() * ranks]  # equal shards: the bytes rounded down to them

            def scatter(whole: torch.Tensor = whole, shard: torch.Tensor = shard) -> None:
                reduce_scatter_flat(shard, whole, group=group)

            def gather(whole: torch.Tensor = whole, shard: torch.Tensor = shard) -> None:
                all_gather_flat(whole, shard, group=group)

            times[("reduce_scatter", nbytes)] = _median_seconds(scatter, device, repeats)
            times[("all_gather", nbytes)] = _median_seconds(gather, device, repeats)
    if me == 0 and ranks > 1:
        p2p_latency, p2p_bandwidth = _fit(times[("p2p", SMALL_BYTES)], times[("p2p", LARGE_BYTES)], 1.0)
        steps = 2 * (ranks - 1)
        latency, bandwidth = _fit(
            times[("all_reduce", SMALL_BYTES)], times[("all_reduce", LARGE_BYTES)], steps / ranks
        )
        halves = []
        for op in ("reduce_scatter", "all_gather"):
            op_latency, op_bandwidth = _fit(
                times[(op, SMALL_BYTES)], times[(op, LARGE_BYTES)], (ranks - 1) / ranks
            )
            halves += [op_bandwidth, op_latency / (ranks - 1)]
        numbers = torch.tensor(
            [p2p_bandwidth, p2p_latency, bandwidth, latency / steps, *halves], dtype=torch.float64
        )
    if ranks > 1:
        source = dist.get_global_rank(group, 0) if group is not None else 0
        # Sent on the CPU: gloo groups take it, and NCCL's can too when given a CUDA copy.
        carrier = numbers.to(device)
        dist.broadcast(carrier, source, group=group)
        numbers = carrier.cpu()
    else:
        return Links(overlap_data_parallel=device.type == "cuda")  # one process: nothing to measure
    p2p_bandwidth, p2p_latency, bandwidth, latency, rs_bandwidth, rs_latency, ag_bandwidth, ag_latency = (
        float(v) for v in numbers
    )
    return Links(
        p2p_bandwidth=p2p_bandwidth,
        p2p_latency=p2p_latency,
        collective_bandwidth=bandwidth,
        collective_latency=latency,
        overlap_data_parallel=device.type == "cuda",
        reduce_scatter_bandwidth=rs_bandwidth,
        reduce_scatter_latency=rs_latency,
        all_gather_bandwidth=ag_bandwidth,
        all_gather_latency=ag_latency,
    )


def median_links(probes: Sequence[Links]) -> Links:
    """Each number the median of ``probes``' (probes of one group taken at different moments): a
    probe lasts half a second, and one taken while other work held a shared host's cores read an
    all-reduce 2 - 3x slower than the others, a layout's every tensor-parallel all-reduce with it
    (the example GPT's pp=1 x tp=4 predicted at 1.5x its measured step for a whole run)."""
    if not probes:
        raise ValueError("median_links needs at least one probe.")
    if len({p.overlap_data_parallel for p in probes}) > 1:
        raise ValueError("median_links needs probes of one kind of device (all overlapping or none).")
    numbers: dict[str, Any] = {}  # each a float, or None where a probe did not measure it
    for f in fields(Links):
        if f.name == "overlap_data_parallel":
            continue
        values = [getattr(p, f.name) for p in probes]
        numbers[f.name] = None if any(v is None for v in values) else float(median(values))
    return replace(probes[0], **numbers)
