"""Run a schedule on paper: message matching, deadlock detection, makespan, bubble and memory.

The simulator plays every rank's action list with given compute times and the *conservative*
rendezvous semantics of NCCL: a batch of sends and receives completes only once the peer of every
one of its messages has posted the batch holding the matching operation, and a rank waits for its
batch before computing again. A schedule that finishes under these rules finishes under gloo's
eager sends too, so one simulation serves as the deadlock check for both backends.

Point-to-point messages between two ranks are matched in the order they are posted (no tags), so
the k-th send on a channel ``src -> dst`` must be the message the k-th receive on ``dst`` expects;
:func:`match_messages` checks that before anything is timed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_pipe.schedule.actions import (
    Action,
    ActionType,
    PipelineSchedule,
    ScheduleError,
    comm_batches,
    is_send,
)

# A message is named by (direction, sending stage, micro-batch), and a skip's also by the stage
# at its other end.
_Message = tuple[str, int, int] | tuple[str, int, int, int]


def _message_of(action: Action) -> _Message:
    s, i, peer = action.stage_index, action.microbatch, action.peer_stage
    if peer is not None:  # skip connections: named from the sender's side
        if action.kind is ActionType.SEND_SKIP:
            return ("SF", s, i, peer)
        if action.kind is ActionType.RECV_SKIP:
            return ("SF", peer, i, s)
        if action.kind is ActionType.SEND_SKIP_GRAD:
            return ("SB", s, i, peer)
        return ("SB", peer, i, s)
    if action.kind is ActionType.SEND_F:
        return ("F", s, i)
    if action.kind is ActionType.RECV_F:
        return ("F", s - 1, i)
    if action.kind is ActionType.SEND_B:
        return ("B", s, i)
    if action.kind is ActionType.RECV_B:
        return ("B", s + 1, i)
    raise ValueError(f"{action} is not a communication action")


def match_messages(schedule: PipelineSchedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair every send with its receive: ``(rank, index) -> (peer_rank, peer_index)``.

    Raises :class:`ScheduleError` when a channel's sends and receives disagree in number or order,
    which on a real network would hand one micro-batch's tensor to another's receive.
    """
    sends: dict[tuple[int, int], list[tuple[_Message, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[_Message, int]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            if action.kind.is_compute:
                continue
            peer = schedule.peer_rank(action)
            if is_send(action.kind):
                sends[(rank, peer)].append((_message_of(action), index))
            else:
                recvs[(peer, rank)].append((_message_of(action), index))
    partners: dict[tuple[int, int], tuple[int, int]] = {}
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        sent = [m for m, _ in sends[channel]]
        expected = [m for m, _ in recvs[channel]]
        if sent != expected:
            raise ScheduleError(
                f"Messages from pipeline rank {src} to rank {dst} do not pair up in order: "
                f"rank {src} sends {sent} but rank {dst} receives {expected}. Each receive must "
                "be posted in the same order as the sends it matches."
            )
        for (_, i_send), (_, i_recv) in zip(sends[channel], recvs[channel], strict=True):
            partners[(src, i_send)] = (dst, i_recv)
            partners[(dst, i_recv)] = (src, i_send)
    return partners


@dataclass(frozen=True)
class TimedAction:
    """An action as the simulator (or a recorded run) placed it in time."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What a schedule costs with the given compute times."""

    makespan: float
    busy: tuple[float, ...]
    """Compute time of each rank."""
    peak_inflight: tuple[int, ...]
    """Per stage: the most micro-batches whose activations were alive at once."""
    timeline: tuple[TimedAction, ...]

    @property
    def bubble_fraction(self) -> float:
        """Share of all ranks' time spent idle: ``1 - sum(busy) / (ranks * makespan)``."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    """``value`` as one number per stage: a single number for every stage, or a sequence whose
    length is checked against ``num_stages`` (``name`` is what the error calls it)."""
    if isinstance(value, int | float):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries but the schedule has {num_stages} stages.")
    return values


def _held_change(kind: ActionType) -> int:
    """What an action does to the micro-batches its stage holds for backward: a forward keeps one,
    its backward (a split backward's weight pass, the last to need them) releases it."""
    if kind is ActionType.FORWARD:
        return 1
    if kind in (ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT):
        return -1
    return 0


def held_peak(
    schedule: PipelineSchedule,
    rank: int,
    saved: Mapping[int, float],
    replayed: Mapping[int, float] | None = None,
) -> float:
    """The most bytes ``rank`` holds for backward at once under ``schedule``, a micro-batch of
    stage ``s`` holding ``saved[s]``: its actions played in their order. Only the rank's own actions
    move its memory, so no timing is needed. With several stages a rank (interleaved), the stages'
    own peaks (:attr:`SimulationResult.peak_inflight`) do not coincide, and their sum overstates
    the rank's: the layout planner's, which summed them, put the example GPT at pp=4, interleaved
    v=2, 8 micro-batches at 33.2 MB a rank where the run held 26.5 MB.

    ``replayed``: with recomputation under a split backward, the bytes of stage ``s``'s forward run
    again at a micro-batch's input-gradient pass, held with it until its weight pass. ZB-H1's rank
    ``r`` defers its weight passes by ``r`` micro-batches, so its last rank holds up to ``pp``
    replayed graphs at once where a plain backward holds one only while it runs (3 ranks, 6
    micro-batches: 1, 2 and 3 at the ranks' peaks, beside the stage inputs and outputs kept; on the
    last rank that is more than the same schedule holds without recomputation)."""
    held = peak = 0.0
    for action in schedule.actions[rank]:
        s = action.stage_index
        change = _held_change(action.kind)
        if change:
            held += change * saved[s]
        if replayed is not None and action.kind is ActionType.BACKWARD_INPUT:
            held += replayed[s]
        elif replayed is not None and action.kind is ActionType.BACKWARD_WEIGHT:
            held -= replayed[s]
        peak = max(peak, held)
    return peak


def simulate(
    schedule: PipelineSchedule,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    comm_time: float = 0.0,
    pace: Mapping[Action, float] | None = None,
) -> SimulationResult:
    """Time ``schedule`` with per-stage compute costs; raise :class:`ScheduleError` on deadlock.

    A split backward (``BACKWARD_INPUT`` then ``BACKWARD_WEIGHT``) costs half of ``backward_time``
    for each half. ``pace`` stretches single computations (a factor per action, 1 where absent):
    :mod:`lightning_pipe.schedule.shared_cores` uses it for processes that share cores.
    """
    tf = per_stage(forward_time, schedule.num_stages, "forward_time")
    tb = per_stage(backward_time, schedule.num_stages, "backward_time")
    partners = match_messages(schedule)
    groups = [comm_batches(list(a)) for a in schedule.actions]
    # Index of the batch that holds each action, to find a message's peer batch.
    group_of: list[list[int]] = []
    for rank_groups in groups:
        owner: list[int] = []
        for g, batch in enumerate(rank_groups):
            owner.extend([g] * len(batch))
        group_of.append(owner)
    first_index = [[0] * len(rg) for rg in groups]
    for r, rank_groups in enumerate(groups):
        position = 0
        for g, batch in enumerate(rank_groups):
            first_index[r][g] = position
            position += len(batch)

    n = schedule.num_ranks
    pointer = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    posted: list[dict[int, float]] = [{} for _ in range(n)]
    inflight = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    timeline: list[TimedAction] = []

    def duration(action: Action) -> float:
        s = action.stage_index
        factor = 1.0 if pace is None else pace.get(action, 1.0)
        if action.kind is ActionType.FORWARD:
            return tf[s] * factor
        if action.kind is ActionType.BACKWARD:
            return tb[s] * factor
        return tb[s] / 2 * factor

    progressed = True
    while progressed:
        progressed = False
        for r in range(n):
            while pointer[r] < len(groups[r]):
                g = pointer[r]
                batch = groups[r][g]
                if batch[0].kind.is_compute:
                    action = batch[0]
                    start = clock[r]
                    clock[r] += duration(action)
                    busy[r] += clock[r] - start
                    timeline.append(TimedAction(r, action, start, clock[r]))
                    s = action.stage_index
                    inflight[s] += _held_change(action.kind)
                    peak[s] = max(peak[s], inflight[s])
                else:
                    posted[r].setdefault(g, clock[r])
                    ready = clock[r]
                    blocked = False
                    for k in range(len(batch)):
                        peer, peer_index = partners[(r, first_index[r][g] + k)]
                        peer_group = group_of[peer][peer_index]
                        if peer_group not in posted[peer]:
                            blocked = True
                            break
                        ready = max(ready, posted[peer][peer_group])
                    if blocked:
                        break
                    start = clock[r]
                    clock[r] = ready + comm_time
                    for action in batch:
                        timeline.append(TimedAction(r, action, start, clock[r]))
                pointer[r] += 1
                progressed = True

    stuck = [r for r in range(n) if pointer[r] < len(groups[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits in [{', '.join(map(str, groups[r][pointer[r]]))}]" for r in stuck)
        raise ScheduleError(f"Schedule {schedule.name!r} deadlocks: {waits}.")
    return SimulationResult(
        makespan=max(clock, default=0.0),
        busy=tuple(busy),
        peak_inflight=tuple(peak),
        timeline=tuple(timeline),
    )
