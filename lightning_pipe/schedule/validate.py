"""Check that a schedule can run: every action present once, in a legal order, and no deadlock.

The executor trusts its schedule, so everything it would otherwise discover mid-step (a backward
with no stashed forward, a receive that never comes) is caught here, on paper, in one process.
"""

from __future__ import annotations

import itertools
from collections import Counter

from lightning_pipe.schedule.actions import (
    Action,
    ActionType,
    PipelineSchedule,
    ScheduleError,
    skip_neighbours,
)
from lightning_pipe.schedule.simulate import simulate


def _expect_once(counts: Counter[Action], action: Action, rank: int) -> None:
    seen = counts[action]
    if seen != 1:
        raise ScheduleError(f"Rank {rank} must run {action} exactly once, but it appears {seen} times.")


def validate_schedule(schedule: PipelineSchedule) -> None:
    """Raise :class:`ScheduleError` naming the first problem found in ``schedule``."""
    p, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.stage_to_rank) != p:
        raise ScheduleError(f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {p} stages.")
    if sorted(set(schedule.stage_to_rank)) != list(range(schedule.num_ranks)):
        raise ScheduleError(
            f"stage_to_rank {schedule.stage_to_rank} must use every rank 0..{schedule.num_ranks - 1}."
        )
    last = p - 1
    for a, c in schedule.skips:
        if not 0 <= a < c < p:
            raise ScheduleError(
                f"Skip connection {a} -> {c} is not a pair of stages producer < consumer < {p}."
            )
    consumers, producers = skip_neighbours(schedule.skips)
    for rank, actions in enumerate(schedule.actions):
        position = {a: k for k, a in enumerate(actions)}
        counts = Counter(actions)
        for action in actions:
            if not 0 <= action.stage_index < p or not 0 <= action.microbatch < m:
                raise ScheduleError(f"Rank {rank} has {action}, outside {p} stages x {m} micro-batches.")
            if schedule.stage_to_rank[action.stage_index] != rank:
                raise ScheduleError(
                    f"Rank {rank} runs {action}, but stage {action.stage_index} lives on rank "
                    f"{schedule.stage_to_rank[action.stage_index]}."
                )
        needed_comms: set[Action] = set()
        split = any(a.kind is ActionType.BACKWARD_INPUT for a in actions)
        grad_actions = (2 if split else 1) if schedule.training else 0
        for s in schedule.stages_of(rank):
            for i in range(m):
                fwd = Action(s, ActionType.FORWARD, i)
                _expect_once(counts, fwd, rank)
                if not schedule.training:
                    grads = []
                elif split:
                    grads = [
                        Action(s, ActionType.BACKWARD_INPUT, i),
                        Action(s, ActionType.BACKWARD_WEIGHT, i),
                    ]
                else:
                    grads = [Action(s, ActionType.BACKWARD, i)]
                for grad in grads:
                    _expect_once(counts, grad, rank)
                order = [fwd, *grads]
                for before, after in itertools.pairwise(order):
                    if position[before] > position[after]:
                        raise ScheduleError(f"Rank {rank} runs {after} before {before}.")
                needs = []
                if s > 0 and schedule.stage_to_rank[s - 1] != rank:
                    needs += [(Action(s, ActionType.RECV_F, i), fwd, True)]
                    if grads:
                        needs += [(Action(s, ActionType.SEND_B, i), grads[0], False)]
                if s < last and schedule.stage_to_rank[s + 1] != rank:
                    needs += [(Action(s, ActionType.SEND_F, i), fwd, False)]
                    if grads:
                        needs += [(Action(s, ActionType.RECV_B, i), grads[0], True)]
                # Skip connections: the stashed tensors go straight to each consumer on another
                # rank after the forward; their gradients come back before the backward.
                for c in consumers.get(s, ()):
                    if schedule.stage_to_rank[c] != rank:
                        needs += [(Action(s, ActionType.SEND_SKIP, i, c), fwd, False)]
                        if grads:
                            needs += [(Action(s, ActionType.RECV_SKIP_GRAD, i, c), grads[0], True)]
                for a in producers.get(s, ()):
                    if schedule.stage_to_rank[a] != rank:
                        needs += [(Action(s, ActionType.RECV_SKIP, i, a), fwd, True)]
                        if grads:
                            needs += [(Action(s, ActionType.SEND_SKIP_GRAD, i, a), grads[0], False)]
                needed_comms.update(comm for comm, _, _ in needs)
                for comm, compute, comes_first in needs:
                    _expect_once(counts, comm, rank)
                    if (position[comm] < position[compute]) != comes_first:
                        where = "before" if comes_first else "after"
                        raise ScheduleError(f"Rank {rank} must run {comm} {where} {compute}.")
        for action in actions:
            if action.kind.is_comm and action not in needed_comms:
                raise ScheduleError(
                    f"Rank {rank} has {action}, which no computation of its stages needs "
                    "(a message past the first or last stage, across a rank boundary that does not "
                    "exist, a skip connection the schedule does not list, or a gradient in a "
                    "forward-only schedule)."
                )
        expected = (1 + grad_actions) * m * len(schedule.stages_of(rank))
        computes = sum(1 for a in actions if a.kind.is_compute)
        if computes != expected:
            raise ScheduleError(f"Rank {rank} has {computes} compute actions, expected {expected}.")
    # Message order and deadlock freedom: the simulator raises on either.
    simulate(schedule)
