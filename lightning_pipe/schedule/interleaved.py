"""Interleaved 1F1B: several stages per pipeline rank (Narayanan et al. 2021, Megatron's virtual
pipeline), for any number of micro-batches.

Each of the ``p`` ranks holds ``v`` stages in loop placement (rank ``r`` holds stages
``r, r + p, ..., r + (v - 1) p``), so a micro-batch passes every rank ``v`` times and the pipeline
fills in ``1/v`` of the time: with equal stage times the bubble is ``(p - 1) / (v m + p - 1)``
instead of 1F1B's ``(p - 1) / (m + p - 1)``.

The order within a rank follows Megatron: forwards go through the micro-batches in groups of
``p``, all of a group's micro-batches on the rank's first stage, then on its second, ...;
backwards in the same groups with the stages reversed; a rank keeps at most
``2 (p - r - 1) + (v - 1) p + 1`` forwards ahead of its backwards (Megatron's warm-up plus the
steady state's one). Megatron and torch require ``m`` to be a multiple of ``p``; here the
interleaving of each rank's two sequences is not fixed in advance but decided by a lock-step
walk (:mod:`.lockstep`) over ticks in which every rank runs at most one forward and one backward
whose inputs arrived in an earlier tick. The walk never stalls (a rank whose cap is reached has a
backward that becomes ready). For ``m`` a multiple of ``p`` this gives exactly Megatron's
schedule and bubble; for other ``m`` the bubble lies between that and 1F1B's (tested for
p in {2, 3, 4, 8}, v in {2, 3}, m in 1..32).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedule.actions import Action, ActionType, ScheduleError
from lightning_pipe.schedule.lockstep import LockStep


def loop_placement(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """``stage_to_rank`` of interleaved schedules: stage ``s`` on rank ``s % num_ranks``."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))


def _sequences(p: int, v: int, m: int, rank: int, training: bool) -> tuple[list[Action], list[Action]]:
    """Rank ``rank``'s forwards and backwards, each in Megatron's order."""
    forwards: list[Action] = []
    backwards: list[Action] = []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        forwards += [Action(c * p + rank, ActionType.FORWARD, i) for c in range(v) for i in group]
        if training:
            backwards += [
                Action(c * p + rank, ActionType.BACKWARD, i) for c in reversed(range(v)) for i in group
            ]
    return forwards, backwards


def interleaved_actions(
    num_ranks: int,
    virtual_stages: int,
    num_microbatches: int,
    training: bool = True,
    skips: Sequence[tuple[int, int]] = (),
) -> list[list[Action]]:
    """Every rank's actions, communication included, for the interleaved 1F1B schedule (or,
    ``training=False``, its forward-only counterpart)."""
    p, v, m = num_ranks, virtual_stages, num_microbatches
    if p < 2 or v < 1:
        raise ValueError(
            f"Interleaved schedules need at least 2 pipeline ranks and 1 stage per rank, got {p} ranks and "
            f"{v} stages per rank."
        )
    walk = LockStep(loop_placement(p, v), skips=skips)
    sequences = [_sequences(p, v, m, r, training) for r in range(p)]
    # Megatron's warm-up plus one: the most forwards a rank runs ahead of its backwards (no limit
    # without backwards: evaluation holds no activations for a backward).
    caps = [min(m * v, 2 * (p - r - 1) + (v - 1) * p) + 1 if training else m * v for r in range(p)]
    next_forward, next_backward = [0] * p, [0] * p
    remaining = sum(len(f) + len(b) for f, b in sequences)
    while remaining:
        ran = False
        for r in range(p):
            forwards, backwards = sequences[r]
            candidates = []
            if next_forward[r] < len(forwards) and next_forward[r] - next_backward[r] < caps[r]:
                candidates.append(forwards[next_forward[r]])
            if next_backward[r] < len(backwards):
                candidates.append(backwards[next_backward[r]])
            for action in candidates:
                if not walk.ready(action):
                    continue
                walk.run(action)
                remaining, ran = remaining - 1, True
                if action.kind is ActionType.FORWARD:
                    next_forward[r] += 1
                else:
                    next_backward[r] += 1
        if not ran:  # unreachable for the orders above; the validator would also catch it
            raise ScheduleError(
                f"Interleaved 1F1B ({p} ranks, {v} stages each, {m} micro-batches) stalls at tick "
                f"{walk.tick}."
            )
        walk.end_tick()
    return walk.actions()
