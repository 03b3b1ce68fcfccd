"""The one lowering of per-rank compute orders to action lists: a lock-step walk in ticks.

Every schedule is built in two parts: what each rank computes in which order (a builder decides,
before or during the walk), and the sends and receives that order implies, which this module
inserts for all of them alike. Time advances in ticks; in a tick every rank runs computations
whose inputs were produced in an *earlier* tick (or on the same rank). A message is sent right
after the computation that produces it; its receive is placed, on the receiving rank, either

* where the message is produced (``ReceiveAt.PRODUCED``): the receive is posted as soon as it
  can be, which zero-bubble and interleaved schedules want (their ranks have other work, weight
  passes or other stages, to overlap the transfer with), or
* just before the tick that needs it (``ReceiveAt.NEEDED``): a rank never waits for data it does
  not need yet, and in 1F1B's steady state a send of one micro-batch and the receive of another
  form one exchange on both ends (Megatron's ``send_forward_recv_backward``): GPipe and 1F1B.

Either way the receives on one channel stay in the order of its sends (a receive is never placed
after a later message's), every exchange is posted sends first, and a rank never waits for a
message whose producer still waits for it: the schedules cannot deadlock (the validator checks it
regardless). With unit-time computations one tick is one unit of time, which is what makes the
builders' simulated bubbles exact.

Skip connections (``skips``, producer and consumer stage pairs) add a message from the producer's
forward straight to the consumer's forward and, when training, one from the consumer's gradient
action back to the producer's. They travel on the same channels as the activations, so they are
placed in order with them (a skip's receive where its message is produced, see
:meth:`LockStep.actions`), and the walk waits for them like for any input (the chain of stages
in between already orders them, so no schedule changes its compute order because of a skip).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from lightning_pipe.schedule.actions import Action, ActionType, ScheduleError, skip_neighbours

_GRADIENTS = (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)
"""The actions that produce the gradient of a stage's input."""
_RECEIVES = (ActionType.RECV_F, ActionType.RECV_B)


class ReceiveAt(enum.Enum):
    """Where a receive is placed on its rank (see the module docstring)."""

    PRODUCED = "produced"
    NEEDED = "needed"


class LockStep:
    """The state of a lock-step walk over ``stage_to_rank``'s ranks; :meth:`actions` lowers it."""

    def __init__(
        self,
        stage_to_rank: Sequence[int],
        receive_at: ReceiveAt = ReceiveAt.PRODUCED,
        skips: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.stage_to_rank = tuple(stage_to_rank)
        self.receive_at = receive_at
        # Producer stage -> the later stages that pop what it stashes, and the reverse.
        self.consumers, self.producers = skip_neighbours(skips)
        self.last = len(stage_to_rank) - 1
        self.tick = 0
        self._ran: dict[tuple[str, int, int], int] = {}
        self._computes: list[tuple[int, int, Action]] = []  # (tick, rank, action), in walk order
        self._tick_of: dict[Action, int] = {}

    def _arrived(self, what: str, stage: int, microbatch: int, rank: int) -> bool:
        tick = self._ran.get((what, stage, microbatch))
        return tick is not None and (tick < self.tick or self.stage_to_rank[stage] == rank)

    def ready(self, action: Action) -> bool:
        """Whether ``action``'s inputs exist on its rank at this tick."""
        s, i = action.stage_index, action.microbatch
        rank = self.stage_to_rank[s]
        if action.kind is ActionType.FORWARD:
            return (s == 0 or self._arrived("F", s - 1, i, rank)) and all(
                self._arrived("F", a, i, rank) for a in self.producers.get(s, ())
            )
        if action.kind is ActionType.BACKWARD_WEIGHT:
            return ("G", s, i) in self._ran
        if ("F", s, i) not in self._ran:
            return False
        return (s == self.last or self._arrived("G", s + 1, i, rank)) and all(
            self._arrived("G", c, i, rank) for c in self.consumers.get(s, ())
        )

    def run(self, action: Action) -> None:
        """Run ``action`` in this tick (on its stage's rank)."""
        s, i = action.stage_index, action.microbatch
        if action.kind is ActionType.FORWARD:
            self._ran[("F", s, i)] = self.tick
        elif action.kind in _GRADIENTS:
            self._ran[("G", s, i)] = self.tick
        self._computes.append((self.tick, self.stage_to_rank[s], action))
        self._tick_of[action] = self.tick

    def end_tick(self) -> None:
        self.tick += 1

    def actions(self) -> list[list[Action]]:
        """Every rank's action list: its computations, tick by tick, each tick's exchange after
        them (this rank's sends, then the receives placed in that tick)."""
        ranks, ticks = max(self.stage_to_rank) + 1, self.tick + 1
        computes: list[list[list[Action]]] = [[[] for _ in range(ticks)] for _ in range(ranks)]
        exchanges: list[list[list[tuple[bool, tuple[int, ...], Action]]]] = [
            [[] for _ in range(ticks)] for _ in range(ranks)
        ]
        channels: dict[tuple[int, int, int], list[tuple[int, tuple[int, ...], Action, int]]] = {}
        for tick, rank, action in self._computes:
            computes[rank][tick].append(action)
            for key, send, recv, consumer in self._messages_of(action):
                peer = self.stage_to_rank[consumer.stage_index]
                exchanges[rank][tick].append((False, key, send))
                channels.setdefault((rank, peer, key[1]), []).append(
                    (tick, key, recv, self._tick_of[consumer])
                )
        for (_, receiver, _), messages in channels.items():
            messages.sort(key=lambda m: (m[0], m[1]))  # production order: the channel's order
            place = ticks
            for produced, key, recv, needed in reversed(messages):
                # A skip's receive is always posted where its message is produced: its consumer
                # may need it many ticks later, and under NCCL's rendezvous the producer's whole
                # exchange would wait that long, while the stages in between wait for the producer.
                early = self.receive_at is ReceiveAt.PRODUCED or recv.kind.is_skip
                place = produced if early else min(place, needed - 1)
                exchanges[receiver][place].append((True, key, recv))
        out: list[list[Action]] = []
        for rank in range(ranks):
            actions: list[Action] = []
            for tick in range(ticks):
                actions += computes[rank][tick]
                actions += [a for _, _, a in sorted(exchanges[rank][tick], key=lambda e: (e[0], e[1]))]
            out.append(actions)
        return out

    def _gradient_action(self, s: int, i: int) -> Action:
        """Stage ``s``'s action that needs the gradient of its outputs for micro-batch ``i``."""
        return next(Action(s, kind, i) for kind in _GRADIENTS if Action(s, kind, i) in self._tick_of)

    def _messages_of(self, action: Action) -> list[tuple[tuple[int, ...], Action, Action, Action]]:
        """The messages ``action`` produces: (order key, send, receive, the consumer). A skip's key
        extends its activation's (or gradient's), so on a shared channel it follows it."""
        s, i, rank = action.stage_index, action.microbatch, self.stage_to_rank[action.stage_index]
        out: list[tuple[tuple[int, ...], Action, Action, Action]] = []
        if action.kind is ActionType.FORWARD:
            if s < self.last and self.stage_to_rank[s + 1] != rank:
                consumer = Action(s + 1, ActionType.FORWARD, i)
                out.append(
                    (
                        (s, 0, i),
                        Action(s, ActionType.SEND_F, i),
                        Action(s + 1, ActionType.RECV_F, i),
                        consumer,
                    )
                )
            for c in self.consumers.get(s, ()):
                if self.stage_to_rank[c] != rank:
                    send = Action(s, ActionType.SEND_SKIP, i, c)
                    recv = Action(c, ActionType.RECV_SKIP, i, s)
                    out.append(((s, 0, i, c), send, recv, Action(c, ActionType.FORWARD, i)))
        if action.kind in _GRADIENTS:
            if s > 0 and self.stage_to_rank[s - 1] != rank:
                consumer = self._gradient_action(s - 1, i)
                out.append(
                    (
                        (s, 1, i),
                        Action(s, ActionType.SEND_B, i),
                        Action(s - 1, ActionType.RECV_B, i),
                        consumer,
                    )
                )
            for a in self.producers.get(s, ()):
                if self.stage_to_rank[a] != rank:
                    send = Action(s, ActionType.SEND_SKIP_GRAD, i, a)
                    recv = Action(a, ActionType.RECV_SKIP_GRAD, i, s)
                    out.append(((s, 1, i, a), send, recv, self._gradient_action(a, i)))
        return out


def lower(
    orders: Sequence[Sequence[Action]],
    stage_to_rank: Sequence[int],
    receive_at: ReceiveAt,
    what: str,
    skips: Sequence[tuple[int, int]] = (),
) -> list[list[Action]]:
    """Walk fixed per-rank compute orders in lock step (each rank runs its next computation as soon
    as its inputs exist, at most one per tick) and lower them (``what`` names the schedule)."""
    walk = LockStep(stage_to_rank, receive_at, skips)
    position = [0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        ran = False
        for r, order in enumerate(orders):
            if position[r] < len(order) and walk.ready(order[position[r]]):
                walk.run(order[position[r]])
                position[r] += 1
                ran = True
        if not ran:  # unreachable for orders that respect their dependencies
            raise ScheduleError(f"{what} stalls at tick {walk.tick}: no rank can run its next computation.")
        walk.end_tick()
    return walk.actions()
