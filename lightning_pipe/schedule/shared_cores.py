"""A schedule run by processes that share cores: each computation slowed by how many compute at once.

gloo processes on one host's CPU share its cores. When more of them compute at once than the host
gives full speed to (its compute slots, probed by
:func:`lightning_pipe.planning.cores.probe_compute_slots`), each computes slower. A pipeline's
ranks are not all busy at once: in the warm-up and the cool-down few compute and run near full
speed, in the steady state all do and share the cores. Neither bound of the step is right then:
the plain simulation (:func:`~lightning_pipe.schedule.simulate.simulate`, every rank at full
speed) is short by the steady state's slowdown, and the total work over the slots is short by the
bubble, whose idle ranks cannot lend their cores to the work on the critical path (4 gloo
processes on 2 cores, the example GPT at pp=4, 1F1B, 4 micro-batches: both bounds said 0.17 -
0.19 s, the executor ran 0.23 s).

So each computation is paced by the processes computing during it (an approximation of
processor sharing): the average number of pipeline ranks computing over its span, times the
processes that run each pipeline rank's work at once (its tensor and data ranks), over the slots,
at least 1. The spans come from a simulation, which the paces change: the schedule is simulated
again with each computation stretched by its pace, each pace moving half-way to the new estimate
after the first round (damped: a pace that overshoots would otherwise swing back and forth),
until no pace moves by more than a thousandth. A fixed point, not an exact processor-sharing
simulation (where a span's rate changes within it): the spans are the simulator's, whose ranks
keep their own clocks, so the sharing is read off the previous round's overlaps. On the hand-made
cases of ``tests/test_schedules.py`` it lands on the exact answer.

Part of a computation may be a wait rather than work: a tensor-parallel all-reduce inside a
layer, timed by the links' probe with every process on the cores already. That part keeps its
time (``unpaced_forward``, ``unpaced_backward``); only the rest is slowed. The computation still
counts as under way for the others' paces over its whole span: gloo copies and sums on the cores
(the safe side; no measurement here tells the two apart).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule
from lightning_pipe.schedule.simulate import SimulationResult, TimedAction, per_stage, simulate

ROUNDS = 12
"""At most this many rounds of the fixed point (each one simulation); it stops earlier once no
pace moves by more than :data:`TOLERANCE`."""

TOLERANCE = 1e-3


def simulate_shared(
    schedule: PipelineSchedule,
    forward_time: float | Sequence[float],
    backward_time: float | Sequence[float],
    comm_time: float,
    slots: float,
    processes_per_rank: int = 1,
    rounds: int = ROUNDS,
    plain: SimulationResult | None = None,
    unpaced_forward: float | Sequence[float] = 0.0,
    unpaced_backward: float | Sequence[float] = 0.0,
) -> SimulationResult:
    """``schedule`` timed as :func:`~lightning_pipe.schedule.simulate.simulate` does, with each
    computation slowed by the processes computing during it beyond ``slots`` (see the module
    docstring); ``busy`` holds the slowed times. ``processes_per_rank``: the processes that run
    each pipeline rank's work at the same time (tensor x data parallel sizes). ``plain``: the
    schedule's plain simulation with the same times, if the caller has it. Where the slots cover
    every process it is the plain simulation. Slots below 1 (the probe's reading when other jobs
    load the host) slow even a computation that runs alone, as they do on such a host.
    ``unpaced_forward`` / ``unpaced_backward``: of each stage's forward / backward time, the
    seconds that are waits, not slowed (see the module docstring)."""
    if slots <= 0:
        raise ValueError(f"slots must be positive, got {slots}.")
    if plain is None:
        plain = simulate(schedule, forward_time, backward_time, comm_time)
    if slots >= schedule.num_ranks * processes_per_rank:
        return plain
    paced = _paced_shares(schedule, forward_time, backward_time, unpaced_forward, unpaced_backward)
    result = plain
    pace: dict[Action, float] = {}
    for _ in range(rounds):
        # Only an action's paced share slows: [0] a forward's, [1] a backward's (or its halves').
        estimate = {
            a: 1 + (p - 1) * paced[a.stage_index][a.kind is not ActionType.FORWARD]
            for a, p in _paces(result.timeline, slots, processes_per_rank).items()
        }
        # The first round takes the estimate whole, later ones move half-way to it.
        updated = {a: (pace[a] + p) / 2 if a in pace else p for a, p in estimate.items()}
        moved = max((abs(p - pace.get(a, 1.0)) for a, p in updated.items()), default=0.0)
        pace = updated
        result = simulate(schedule, forward_time, backward_time, comm_time, pace=pace)
        if moved < TOLERANCE:
            break
    return result


def _paced_shares(
    schedule: PipelineSchedule,
    forward_time: float | Sequence[float],
    backward_time: float | Sequence[float],
    unpaced_forward: float | Sequence[float],
    unpaced_backward: float | Sequence[float],
) -> list[tuple[float, float]]:
    """Per stage, the shares of its forward and of its backward that sharing the cores slows."""
    n = schedule.num_stages

    def share(stage: int, seconds: float, wait: float) -> float:
        if not 0 <= wait <= seconds * (1 + 1e-9):  # the tolerance: sums of the same floats
            raise ValueError(
                f"Stage {stage}'s unpaced seconds ({wait}) must lie between 0 and its time ({seconds})."
            )
        return max(0.0, seconds - wait) / seconds if seconds > 0 else 1.0

    forward, backward = (
        per_stage(forward_time, n, "forward_time"),
        per_stage(backward_time, n, "backward_time"),
    )
    forward_wait = per_stage(unpaced_forward, n, "unpaced_forward")
    backward_wait = per_stage(unpaced_backward, n, "unpaced_backward")
    return [
        (share(s, forward[s], forward_wait[s]), share(s, backward[s], backward_wait[s])) for s in range(n)
    ]


def _paces(timeline: Sequence[TimedAction], slots: float, processes_per_rank: int) -> dict[Action, float]:
    """Each computation's pace: the mean number of processes computing over its span, over the
    slots, at least 1. The count of computations under way is a step function of time; its
    running integral at every start and end makes each span's mean two lookups."""
    computing = [t for t in timeline if t.action.kind.is_compute and t.end > t.start]
    times = sorted({x for t in computing for x in (t.start, t.end)})
    change = [0] * len(times)
    for t in computing:
        change[bisect_left(times, t.start)] += 1
        change[bisect_left(times, t.end)] -= 1
    under_way = list(accumulate(change))
    area = [0.0, *accumulate(under_way[k] * (times[k + 1] - times[k]) for k in range(len(times) - 1))]
    paces: dict[Action, float] = {}
    for t in computing:
        mean = (area[bisect_left(times, t.end)] - area[bisect_left(times, t.start)]) / (t.end - t.start)
        paces[t.action] = max(1.0, mean * processes_per_rank / slots)
    return paces
