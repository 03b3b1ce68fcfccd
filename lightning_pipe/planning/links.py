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

:func:`probe_compute_slots` measures the other thing processes of one host share: compute. The
same fixed piece of work is timed on one rank alone and then on all at once, until the last is
done; if ``n`` processes together take ``k`` times as long, only ``n / k`` of them compute at full
speed at once (4 gloo processes on 2 idle cores: 1.5 - 1.8 for matrix products, the scheduler not
always spreading them evenly; fewer when other jobs share the cores; on GPUs: ``n``). The example
GPT's own layers, forward and backward, read what matrix products read (1.7 - 2.0 against 1.8 - 1.9
in one group), so ``layout="auto"`` probes with matrix products, which need no model. The cost
model reads it as :attr:`~lightning_pipe.planning.costs.Machine.compute_slots`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from statistics import fmean, median_high

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


COMPUTE_PROBE_SIZE = 384
"""The side of the square matrices multiplied by :func:`probe_compute_slots`: about 2 ms a product
on one CPU thread, so that its default 48 of them take a tenth of a second, long against the
barrier that closes the timing and against the scheduler's time slices. 4 processes on 2 cores,
four probes in a row: 16 products of side 192 (20 ms) read 1.42 - 2.37 slots, 48 of side 384
1.80 - 2.09, the example GPT's own layers 1.83 - 1.97."""


def slots_from_times(alone: float, together: float, ranks: int) -> float:
    """How many of ``ranks`` processes' worth of compute the host gives them, when a piece of work
    that takes ``alone`` seconds on one process takes ``together`` on each while all run it:
    ``ranks x alone / together``, at most ``ranks`` (noise can push it above). It may be below 1:
    processes thrashing one another's caches, or other jobs on the host, can make all of them
    together slower than one alone."""
    if together <= 0 or alone <= 0:
        return float(ranks)
    return float(min(ranks, ranks * alone / together))


def slots_from_rounds(alone: Sequence[float], together: Sequence[float], ranks: int) -> float:
    """:func:`slots_from_times` of the probe's rounds: the median of ``alone`` (as the layers are
    timed) against the mean of ``together``.

    The mean, because a step is many stretches of compute between waits, and it pays the slow
    stretches in proportion. Where processes outnumber the cores, "together" is bimodal: the
    scheduler mostly spreads 4 processes 2 and 2 over 2 cores, but in about a round in four puts 3
    on one core, the round 1.5x longer (a run of 40 rounds: 180 - 230 ms, and 300 - 333 ms in 9 of
    them; 90 ms alone). The median reads the fast rounds only (1.78 slots there), and the probe read
    1.13 - 1.81 in windows of 5 rounds, 1.5 - 2.2 in consecutive calls; the mean over 10 rounds read
    1.51 - 1.62."""
    return slots_from_times(median_high(alone), fmean(together), ranks)


def probe_compute_slots(
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    repeats: int = 10,
    products: int = 48,
    work: Callable[[], object] | None = None,
) -> float:
    """How many of ``group``'s processes can compute at once at the speed one has alone (the same
    on every rank; collective). The group's first rank runs ``work`` alone while the others wait,
    then every rank runs it at once, ``repeats`` rounds of both (:func:`slots_from_rounds`).
    ``work`` is a piece of the run's own work (e.g. the model's layers through the layer profiler,
    which read what matrix products read); by default ``products`` products of square matrices.
    On CUDA (a device per process) it is the group's size, unmeasured.

    Both are wall times, and "together" lasts until the last rank is done (barrier to barrier), as
    a training step does: every rank timing only its own run would let the ranks the scheduler
    served first (done early, their cores then lent to the rest) pull the mean down. 4 processes
    on 2 cores read up to 2.5 slots that way, more than the cores, and the plans came out short by
    as much."""
    ranks = dist.get_world_size(group)
    if device.type == "cuda" or ranks == 1:
        return float(ranks)
    me = dist.get_rank(group)
    a = torch.randn(COMPUTE_PROBE_SIZE, COMPUTE_PROBE_SIZE)

    def products_of_matrices() -> None:
        b = a
        for _ in range(products):
            b = torch.tanh(b @ a)  # tanh: keeps the values bounded

    run = work or products_of_matrices
    run()  # warm-up
    alone, together = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        if me == 0:
            start = time.perf_counter()
            run()
            alone.append(time.perf_counter() - start)
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        # The closing barrier's own round counts in (a millisecond or two against the work's
        # tenths of a second): taking off a separately timed empty barrier, whose time varies as
        # much on shared cores, made the estimate noisier, not truer.
        dist.barrier(group=group)
        together.append(time.perf_counter() - start)
    numbers = torch.tensor(
        [slots_from_rounds(alone, together, ranks) if me == 0 else 0.0], dtype=torch.float64
    )
    # Rank 0's reading for every rank (each measured nearly the same "together"): one decision.
    dist.broadcast(numbers, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(numbers[0])


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
