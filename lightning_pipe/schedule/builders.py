"""Pure functions that build pipeline schedules as data (see :mod:`.actions`).

A builder decides each rank's *compute order* (which forward and backward, in which order); the
one lowering of :mod:`.lockstep` then inserts the sends and receives that order implies, for every
schedule alike. Keeping the two apart means a new schedule only has to say what it computes when;
communication placement, and the batching of a send with the opposite receive, come for free and
are checked by the validator.

* GPipe (Huang et al., 2019, arXiv:1811.06965): all forwards, then all backwards. Backwards run in
  reverse micro-batch order so that the last micro-batch, whose activations are the freshest, is
  consumed first (this is what makes torchgpipe's ``checkpoint="except_last"`` pay off).
* 1F1B (PipeDream-Flush, Narayanan et al., 2021, arXiv:2006.09503): stage ``r`` of ``p`` runs
  ``min(p - 1 - r, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. It has the same bubble as GPipe, ``(p - 1) / (m + p - 1)``, but
  keeps at most ``p - r`` micro-batches' activations alive instead of ``m``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from lightning_pipe.arguments import parse_option
from lightning_pipe.schedule.actions import Action, B, F, PipelineSchedule


class ScheduleKind(enum.Enum):
    """The schedules the engine can build."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    """Several stages per rank (``virtual_stages``), see :mod:`lightning_pipe.schedule.interleaved`."""
    ZB_H1 = "zb_h1"
    """Zero-bubble ZB-H1: backward split into input and weight gradients, see
    :mod:`lightning_pipe.schedule.zero_bubble`."""

    @classmethod
    def parse(cls, value: ScheduleKind | str) -> ScheduleKind:
        """Accept the enum or its user-facing name, with an error that lists the valid names."""
        return parse_option(cls, value, "pipeline schedule")

    @property
    def splits_backward(self) -> bool:
        """Whether its backward is split into input- and weight-gradient passes."""
        return self is ScheduleKind.ZB_H1


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}.")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be an integer >= 1, got {num_microbatches!r}. "
            "Set it to the number of pieces each batch is split into (a few times the "
            "pipeline size keeps the bubble small)."
        )


def gpipe_compute_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-rank compute order of GPipe with one stage per rank."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    return [[F(s, i) for i in range(m)] + [B(s, i) for i in reversed(range(m))] for s in range(num_stages)]


def one_f_one_b_compute_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-rank compute order of 1F1B (PipeDream-Flush) with one stage per rank."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    orders: list[list[Action]] = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, m)
        order = [F(s, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [F(s, warmup + i), B(s, i)]
        order += [B(s, i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def forward_only_compute_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-rank compute order for evaluation: every forward in micro-batch order, no backward."""
    _check_sizes(num_stages, num_microbatches)
    return [[F(s, i) for i in range(num_microbatches)] for s in range(num_stages)]


def _skip_pairs(skips: Sequence[tuple[int, int]], num_stages: int) -> tuple[tuple[int, int], ...]:
    pairs = tuple(sorted({(int(a), int(c)) for a, c in skips}))
    for a, c in pairs:
        if not 0 <= a < c < num_stages:
            raise ValueError(
                f"A skip connection from stage {a} to stage {c} is not a pair of an earlier and a later "
                f"stage among {num_stages} stages (producer < consumer)."
            )
    return pairs


def build_schedule(
    kind: ScheduleKind | str,
    num_stages: int,
    num_microbatches: int,
    training: bool = True,
    virtual_stages: int = 1,
    skips: Sequence[tuple[int, int]] = (),
) -> PipelineSchedule:
    """Build and validate the schedule ``kind`` for ``num_stages`` stages on
    ``num_stages // virtual_stages`` pipeline ranks (one stage per rank unless interleaved).

    With ``training=False`` every kind becomes a forward-only schedule (evaluation and prediction
    have no backward to interleave). ``skips``: the ``(producer, consumer)`` stage pairs of skip
    connections (:mod:`lightning_pipe.skip`), whose messages the lowering adds.
    """
    # Imported here: the validator simulates schedules and so depends on this module's types.
    from lightning_pipe.schedule.interleaved import interleaved_actions, loop_placement
    from lightning_pipe.schedule.lockstep import ReceiveAt, lower
    from lightning_pipe.schedule.validate import validate_schedule
    from lightning_pipe.schedule.zero_bubble import zero_bubble_actions

    kind = ScheduleKind.parse(kind)
    _check_sizes(num_stages, num_microbatches)
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or num_stages % virtual_stages:
        raise ValueError(
            f"virtual_stages must be an integer >= 1 that divides num_stages ({num_stages}), "
            f"got {virtual_stages!r}."
        )
    pairs = _skip_pairs(skips, num_stages)
    if virtual_stages > 1 and kind is not ScheduleKind.INTERLEAVED_1F1B:
        raise ValueError(
            f'Several stages per rank (virtual_stages={virtual_stages}) need schedule="interleaved_1f1b", '
            f"not {kind.value!r}."
        )
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        ranks = num_stages // virtual_stages
        stage_to_rank = loop_placement(ranks, virtual_stages)
        actions = interleaved_actions(ranks, virtual_stages, num_microbatches, training, pairs)
        name = kind.value if training else "forward (interleaved)"
    elif kind is ScheduleKind.ZB_H1 and training:
        stage_to_rank = tuple(range(num_stages))
        actions = zero_bubble_actions(num_stages, num_microbatches, pairs)
        name = kind.value
    else:
        builder = {
            ScheduleKind.GPIPE: gpipe_compute_order,
            ScheduleKind.ONE_F_ONE_B: one_f_one_b_compute_order,
            ScheduleKind.ZB_H1: one_f_one_b_compute_order,  # evaluation only: forward-only below
        }[kind]
        stage_to_rank = tuple(range(num_stages))
        orders = (
            builder(num_stages, num_microbatches)
            if training
            else forward_only_compute_order(num_stages, num_microbatches)
        )
        # A receive just before the tick that needs it: a rank never waits for data it does not need
        # yet, and 1F1B's steady state pairs a send with the opposite receive in one exchange.
        actions = lower(orders, stage_to_rank, ReceiveAt.NEEDED, kind.value, pairs)
        name = kind.value if training else "forward"
    schedule = PipelineSchedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_to_rank=stage_to_rank,
        actions=tuple(tuple(a) for a in actions),
        training=training,
        skips=pairs,
    )
    validate_schedule(schedule)
    return schedule
