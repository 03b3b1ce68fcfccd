"""What processes of one host pay for sharing its cores: compute slots, and the wait at each collective.

gloo processes on one host's CPU share its cores, and two things the links' probe
(:mod:`.links`) cannot see follow from it; both are measured here, in the run's own process
group, and read by the cost model from :class:`~lightning_pipe.planning.costs.Machine`:

* **Compute slots** (:func:`probe_compute_slots`). The same fixed piece of work is timed on one
  rank alone and then on all at once, until the last is done; if ``n`` processes together take
  ``k`` times as long, only ``n / k`` of them compute at full speed at once (4 gloo processes on
  2 idle cores: 1.5 - 1.8 for matrix products, the scheduler not always spreading them evenly;
  fewer when other jobs share the cores; on GPUs: ``n``). The example GPT's own layers, forward
  and backward, read what matrix products read (1.7 - 2.0 against 1.8 - 1.9 in one group), so
  ``layout="auto"`` probes with matrix products, which need no model.
* **The wait at each collective** (:func:`probe_collective_wait`). A collective that closes a
  stretch of computation lasts until its last rank arrives, and on oversubscribed cores the
  ranks arrive apart: the scheduler serves some first and the rest finish later. So each costs
  more than the probed links say (the links' probe times collectives back to back, nothing
  computing between) and more than its share of the work over the slots. Measured on this
  project's 4 processes on 2 cores: matrix products in rounds of 0.7 - 13 ms each closed by a
  4 kB all-reduce took 2 - 5 ms a round beyond the same work in one piece and the all-reduces
  alone; in the example GPT's pp=1 x tp=4 step its 31 all-reduces took 324 - 365 ms where the
  links predicted 209 - 254 ms for the layers' 27. Tensor parallelism's all-reduces are such
  collectives, and so are FSDP2's per-layer gathers and reductions and a pipeline's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from statistics import fmean, median, median_high

import torch
import torch.distributed as dist

from lightning_pipe.planning.links import SMALL_BYTES

COMPUTE_PROBE_SIZE = 384
"""The side of the square matrices multiplied by :func:`probe_compute_slots`: about 2 ms a product
on one CPU thread, so that its default 48 of them take a tenth of a second, long against the
barrier that closes the timing and against the scheduler's time slices. 4 processes on 2 cores,
four probes in a row: 16 products of side 192 (20 ms) read 1.42 - 2.37 slots, 48 of side 384
1.80 - 2.09, the example GPT's own layers 1.83 - 1.97."""


def _products(a: torch.Tensor, count: int) -> None:
    """``count`` products of ``a`` with itself in a chain, the probes' default work (tanh keeps the
    values bounded)."""
    b = a
    for _ in range(count):
        b = torch.tanh(b @ a)


def _barrier_to_barrier(run: Callable[[], object], group: dist.ProcessGroup | None) -> float:
    """Seconds from a barrier to the barrier after ``run``: until the group's last rank is done, as
    a training step lasts. The closing barrier's own round counts in (a millisecond or two against
    the probes' tenths of a second): taking off a separately timed empty barrier, whose time
    varies as much on shared cores, made the estimate noisier, not truer."""
    dist.barrier(group=group)
    start = time.perf_counter()
    run()
    dist.barrier(group=group)
    return time.perf_counter() - start


def _rank0s(value: float, group: dist.ProcessGroup | None) -> float:
    """The group's first rank's ``value`` on every rank (collective): one decision everywhere."""
    numbers = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(numbers, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(numbers[0])


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
    run = work or (lambda: _products(a, products))
    run()  # warm-up
    alone, together = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        if me == 0:
            start = time.perf_counter()
            run()
            alone.append(time.perf_counter() - start)
        together.append(_barrier_to_barrier(run, group))
    # Rank 0's reading for every rank (each measured nearly the same "together").
    return _rank0s(slots_from_rounds(alone, together, ranks) if me == 0 else 0.0, group)


WAIT_PROBE_ROUNDS = 24
"""The stretches of work :func:`probe_collective_wait` times, each closed by a collective: 2
products of :data:`COMPUTE_PROBE_SIZE` (about 4 ms alone) a stretch by default, as long as a
transformer layer's compute between two tensor-parallel all-reduces on this project's CPU models,
and enough rounds that the wait (a few milliseconds each) stands above the noise of the three
timings it is the difference of."""


def wait_from_times(
    together: Sequence[float], in_rounds: Sequence[float], collectives: Sequence[float], count: int
) -> float:
    """What each of ``count`` collectives costs beyond its own time when it closes a stretch of
    computation, from the probe's repeats (index ``i`` of each sequence timed in turn): the work
    cut into ``count`` rounds each closed by one collective took ``in_rounds[i]``; the work in one
    piece ``together[i]``; the collectives back to back, nothing computing, ``collectives[i]``.
    Each repeat's excess per collective, the median of them, never below 0: one probe's eight
    repeats read -0.8 - 4.4 ms (median 2.0) on this project's 4 processes on 2 cores, and four
    probes taking the mean of their repeats read 0.3 - 9.0 ms, four taking the median 1.3 - 3.2."""
    if count < 1:
        raise ValueError(f"count must be >= 1 collective, got {count}.")
    if not len(together) == len(in_rounds) == len(collectives) >= 1:
        raise ValueError(
            "wait_from_times needs one time of each kind per repeat, got "
            f"{len(together)}, {len(in_rounds)} and {len(collectives)}."
        )
    excess = [(c - t - a) / count for t, c, a in zip(together, in_rounds, collectives, strict=True)]
    return max(0.0, median(excess))


def probe_collective_wait(
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    rounds: int = WAIT_PROBE_ROUNDS,
    products: int = 2,
    stretch: Callable[[int], object] | None = None,
) -> float:
    """Seconds each collective waits, beyond its own time, for the last of ``group``'s ranks to
    arrive when every rank computes between collectives (the same on every rank; collective). On
    CUDA (a device per process, nothing shared) and for one process: 0, unmeasured.

    Every rank runs ``rounds`` stretches of work three ways, ``repeats`` times in turn (the
    machine's drift falls on all three alike): one after the other; each closed by a small
    all-reduce; and the all-reduces alone, back to back. Each way is timed barrier to barrier
    (:func:`_barrier_to_barrier`: a closing barrier in each, one left over in the difference, a
    millisecond against the rounds' waits); :func:`wait_from_times` reads them, and rank 0's
    reading is every rank's. A stretch is ``products`` products of square matrices by default,
    ``stretch(i)`` for round ``i`` if given. About 0.9 s a repeat on this project's 4 processes on
    2 cores."""
    ranks = dist.get_world_size(group)
    if device.type == "cuda" or ranks == 1:
        return 0.0
    me = dist.get_rank(group)
    a = torch.randn(COMPUTE_PROBE_SIZE, COMPUTE_PROBE_SIZE)
    buffer = torch.zeros(SMALL_BYTES // 4)
    work = stretch or (lambda _: _products(a, products))

    def in_one_piece() -> None:
        for i in range(rounds):
            work(i)

    def in_rounds() -> None:
        for i in range(rounds):
            work(i)
            dist.all_reduce(buffer, group=group)

    def collectives() -> None:
        for _ in range(rounds):
            dist.all_reduce(buffer, group=group)

    in_rounds()  # warm-up: the connections, the allocations
    times: tuple[list[float], list[float], list[float]] = ([], [], [])
    for _ in range(repeats):
        for kept, run in zip(times, (in_one_piece, in_rounds, collectives), strict=True):
            kept.append(_barrier_to_barrier(run, group))
    return _rank0s(wait_from_times(*times, rounds) if me == 0 else 0.0, group)
