"""Lower per-rank compute choices to action lists in lock-step ticks, communication included.

Builders that decide *while* walking the pipeline which computation a rank runs next (interleaved
1F1B's choice between a forward and a backward, zero-bubble's fixed order that must wait for its
inputs) share this lowering. Time advances in ticks; in a tick every rank runs computations whose
inputs were produced in an *earlier* tick (or on the same rank), and at the end of the tick every
message produced in it is appended, sender and receiver alike, in one order common to both ends.
So every message is sent and received in the tick after its producer ran, the exchanges of a tick
pair up on both ends of every channel, and a rank never waits for a message whose producer still
waits for it: the schedule cannot deadlock (the validator checks it regardless). With unit-time
computations one tick is one unit of time, which is what makes the builders' simulated bubbles
exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.pipeline.actions import Action, ActionType

_GRADIENTS = (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)
"""The actions that produce the gradient of a stage's input."""


class LockStep:
    """The state of a lock-step walk over ``stage_to_rank``'s ranks."""

    def __init__(self, stage_to_rank: Sequence[int]) -> None:
        self.stage_to_rank = tuple(stage_to_rank)
        self.last = len(stage_to_rank) - 1
        self.tick = 0
        self.actions: list[list[Action]] = [[] for _ in range(max(stage_to_rank) + 1)]
        self._ran: dict[tuple[str, int, int], int] = {}
        self._messages: list[tuple[tuple[int, int, int], int, Action, int, Action]] = []

    def _arrived(self, what: str, stage: int, microbatch: int, rank: int) -> bool:
        tick = self._ran.get((what, stage, microbatch))
        return tick is not None and (tick < self.tick or self.stage_to_rank[stage] == rank)

    def ready(self, action: Action) -> bool:
        """Whether ``action``'s inputs exist on its rank at this tick."""
        s, i = action.stage_index, action.microbatch
        rank = self.stage_to_rank[s]
        if action.kind is ActionType.FORWARD:
            return s == 0 or self._arrived("F", s - 1, i, rank)
        if action.kind is ActionType.BACKWARD_WEIGHT:
            return ("G", s, i) in self._ran
        if ("F", s, i) not in self._ran:
            return False
        return s == self.last or self._arrived("G", s + 1, i, rank)

    def run(self, action: Action) -> None:
        """Append ``action`` to its rank's list and queue the message it produces."""
        s, i = action.stage_index, action.microbatch
        rank = self.stage_to_rank[s]
        self.actions[rank].append(action)
        if action.kind is ActionType.FORWARD:
            self._ran[("F", s, i)] = self.tick
            if s < self.last and self.stage_to_rank[s + 1] != rank:
                send, recv = Action(s, ActionType.SEND_F, i), Action(s + 1, ActionType.RECV_F, i)
                self._messages.append(((s, 0, i), rank, send, self.stage_to_rank[s + 1], recv))
        elif action.kind in _GRADIENTS:
            self._ran[("G", s, i)] = self.tick
            if s > 0 and self.stage_to_rank[s - 1] != rank:
                send, recv = Action(s, ActionType.SEND_B, i), Action(s - 1, ActionType.RECV_B, i)
                self._messages.append(((s, 1, i), rank, send, self.stage_to_rank[s - 1], recv))

    def end_tick(self) -> None:
        """Append the tick's exchanges, in one order on both ends of every pair of ranks."""
        for _, sender, send, receiver, recv in sorted(self._messages, key=lambda message: message[0]):
            self.actions[sender].append(send)
            self.actions[receiver].append(recv)
        self._messages.clear()
        self.tick += 1
