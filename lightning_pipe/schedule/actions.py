"""The action IR: a pipeline schedule is, for every pipeline rank, a list of actions.

Schedules are data (as in ``torch.distributed.pipelining``'s action IR): a pure function builds
them, :mod:`lightning_pipe.schedule.validate` checks them, the simulator times them and one
executor runs any of them. Every action names the *stage* it belongs to (not the rank), so a rank
that holds several stages (interleaved 1F1B) needs no new action kinds, and backward is split
into ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT`` kinds beside ``BACKWARD`` for zero-bubble
schedules.

Communication actions are written from the point of view of the stage that owns them:

* ``SEND_F(s, i)``: stage ``s`` sends its output for micro-batch ``i`` to stage ``s + 1``.
* ``RECV_F(s, i)``: stage ``s`` receives its input for micro-batch ``i`` from stage ``s - 1``.
* ``SEND_B(s, i)``: stage ``s`` sends the gradient of its input to stage ``s - 1``.
* ``RECV_B(s, i)``: stage ``s`` receives the gradient of its output from stage ``s + 1``.

A skip connection (:mod:`lightning_pipe.skip`) moves a tensor from the stage that stashes it
straight to a later, not necessarily adjacent, stage that pops it; its actions name that other
stage in ``peer_stage``:

* ``SEND_S(a, i) > c``: producer stage ``a`` sends the tensors it stashed for micro-batch ``i`` that
  stage ``c`` pops.
* ``RECV_S(c, i) < a``: consumer stage ``c`` receives them from stage ``a``.
* ``SEND_SB(c, i) > a``: stage ``c`` sends the gradients of those tensors back to stage ``a``.
* ``RECV_SB(a, i) < c``: stage ``a`` receives them, before its backward of micro-batch ``i``.

A skip between stages of one rank (within a stage, or between two stages of an interleaved rank)
has no actions: nothing leaves the process.

Consecutive communication actions in a rank's list form one *batch*: they are posted together
(one ``batch_isend_irecv``) and the rank waits for the batch before its next computation.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


class ActionType(enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    """Full backward: gradients of the stage input and of the weights together."""
    BACKWARD_INPUT = "I"
    """Zero-bubble split: gradient of the stage input only (see :mod:`.split_backward`)."""
    BACKWARD_WEIGHT = "W"
    """Zero-bubble split: gradient of the weights, after the stage's ``BACKWARD_INPUT``."""
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SEND_SKIP = "SEND_S"
    """A skip connection's tensors, producer to consumer (``peer_stage`` is the consumer)."""
    RECV_SKIP = "RECV_S"
    """A skip connection's tensors arriving at the consumer (``peer_stage`` is the producer)."""
    SEND_SKIP_GRAD = "SEND_SB"
    """The gradients of a skip connection's tensors, consumer to producer."""
    RECV_SKIP_GRAD = "RECV_SB"
    """The gradients of a skip connection's tensors arriving at the producer."""

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_skip(self) -> bool:
        """A skip connection's message (it names the stage at its other end)."""
        return self in _SKIPS


_COMPUTE = frozenset(
    {
        ActionType.FORWARD,
        ActionType.BACKWARD,
        ActionType.BACKWARD_INPUT,
        ActionType.BACKWARD_WEIGHT,
    }
)


_SKIPS = frozenset(
    {ActionType.SEND_SKIP, ActionType.RECV_SKIP, ActionType.SEND_SKIP_GRAD, ActionType.RECV_SKIP_GRAD}
)


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule: ``kind`` on stage ``stage_index`` for ``microbatch``."""

    stage_index: int
    kind: ActionType
    microbatch: int
    peer_stage: int | None = None
    """The stage at the other end of a skip connection's message (``None`` for every other kind:
    their peer is the adjacent stage)."""

    def __post_init__(self) -> None:
        if self.kind.is_skip != (self.peer_stage is not None):
            raise ValueError(f"A {self.kind.value} action needs peer_stage exactly when it is a skip's.")

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.stage_index}.{self.microbatch}"
        if self.peer_stage is None:
            return text
        arrow = ">" if self.kind in (ActionType.SEND_SKIP, ActionType.SEND_SKIP_GRAD) else "<"
        return f"{text}{arrow}{self.peer_stage}"

    def __repr__(self) -> str:
        return f"Action({self})"


def F(stage_index: int, microbatch: int) -> Action:
    """Shorthand for a forward action, used by schedule builders and tests."""
    return Action(stage_index, ActionType.FORWARD, microbatch)


def B(stage_index: int, microbatch: int) -> Action:
    """Shorthand for a full backward action."""
    return Action(stage_index, ActionType.BACKWARD, microbatch)


@dataclass(frozen=True)
class PipelineSchedule:
    """A complete schedule: the action list of every pipeline rank.

    ``stage_to_rank[s]`` is the pipeline rank (``pp_rank``) that runs stage ``s``. With one stage
    per rank it is the identity; interleaved schedules map several stages to each rank.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    training: bool = True
    """False for forward-only (evaluation) schedules, which have no backward actions."""
    skips: tuple[tuple[int, int], ...] = ()
    """The skip connections between stages as ``(producer, consumer)`` stage pairs, ``producer <
    consumer``, sorted: one message per pair and micro-batch (and one gradient back when
    training) where the two stages live on different ranks."""

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @cached_property
    def splits_backward(self) -> bool:
        """Whether backward is split into input- and weight-gradient actions (zero-bubble)."""
        return any(a.kind is ActionType.BACKWARD_INPUT for actions in self.actions for a in actions)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages that ``pp_rank`` runs, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == pp_rank]

    def peer_rank(self, action: Action) -> int:
        """The pipeline rank at the other end of a communication action."""
        if action.kind in (ActionType.SEND_F, ActionType.RECV_B):
            return self.stage_to_rank[action.stage_index + 1]
        if action.kind in (ActionType.RECV_F, ActionType.SEND_B):
            return self.stage_to_rank[action.stage_index - 1]
        if action.peer_stage is not None:
            return self.stage_to_rank[action.peer_stage]
        raise ValueError(f"{action} is a computation, it has no peer")


def comm_batches(actions: tuple[Action, ...] | list[Action]) -> list[list[Action]]:
    """Group a rank's list into runs: each compute action alone, consecutive comm actions together."""
    groups: list[list[Action]] = []
    for action in actions:
        if action.kind.is_comm and groups and groups[-1][0].kind.is_comm:
            groups[-1].append(action)
        else:
            groups.append([action])
    return groups


def skip_neighbours(
    skips: Sequence[tuple[int, int]],
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """From ``(producer, consumer)`` stage pairs: producer -> its consumers, and consumer -> its
    producers, each in increasing order."""
    consumers: dict[int, list[int]] = {}
    producers: dict[int, list[int]] = {}
    for a, c in sorted(set(skips)):
        consumers.setdefault(a, []).append(c)
        producers.setdefault(c, []).append(a)
    return consumers, producers


def is_send(kind: ActionType) -> bool:
    """Whether a communication action sends (else it receives)."""
    return kind in _SENDS


_SENDS = frozenset({ActionType.SEND_F, ActionType.SEND_B, ActionType.SEND_SKIP, ActionType.SEND_SKIP_GRAD})


class ScheduleError(ValueError):
    """A schedule is malformed: a missing or repeated action, a misordered pair, a deadlock."""
