"""Zero-bubble ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241).

Backward is split into the input gradient I, which the previous stage waits for, and the weight
gradient W, which nobody waits for (:mod:`.split_backward`). ZB-H1 keeps 1F1B's warm-up and
steady alternation of a forward with an I, and lets stage ``r`` postpone its first ``r`` Ws: the
I chain then runs back to the first stage without waiting for any W, and the postponed Ws fill
the time a later stage would spend idle at the end of 1F1B. Stage ``r`` runs, for ``p`` stages
and ``m`` micro-batches:

* ``min(p - 1 - r, m)`` warm-up forwards;
* per remaining micro-batch a forward (while any remain) then the next I, followed by the oldest
  pending W once ``r`` Is have run since the warm-up;
* the remaining Ws.

With unit-time F, I and W the step takes ``max(3m + p - 1, 2m + 2p - 1)``: the bubble is
``(p - 1)(T_F + T_I - T_W)`` for ``m >= p``, a third of 1F1B's ``(p - 1)(T_F + T_I + T_W)``; for
``m < p`` it is the critical path of the last micro-batch. A micro-batch is in flight from its
forward to its W, so every stage holds up to ``p`` micro-batches' activations: 1F1B's peak (its
first stage's), reached on every stage instead of on the first only.

The orders are lowered by the lock-step walk of :mod:`.lockstep`, one computation per rank per
tick, which is what makes the simulated step equal the formula.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.schedule.actions import Action, ActionType
from lightning_pipe.schedule.lockstep import ReceiveAt, lower


def zero_bubble_compute_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-rank compute order of ZB-H1 with one stage per rank (see the module docstring)."""
    p, m = num_stages, num_microbatches
    orders: list[list[Action]] = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(r, ActionType.FORWARD, i) for i in range(warmup)]
        weights = 0
        for k in range(m):
            if warmup + k < m:
                order.append(Action(r, ActionType.FORWARD, warmup + k))
            order.append(Action(r, ActionType.BACKWARD_INPUT, k))
            if k >= r:  # stage r postpones its first r weight gradients
                order.append(Action(r, ActionType.BACKWARD_WEIGHT, weights))
                weights += 1
        order += [Action(r, ActionType.BACKWARD_WEIGHT, k) for k in range(weights, m)]
        orders.append(order)
    return orders


def zero_bubble_actions(
    num_stages: int, num_microbatches: int, skips: Sequence[tuple[int, int]] = ()
) -> list[list[Action]]:
    """Every rank's actions, communication included, for ZB-H1: receives posted as soon as their
    message is produced (a rank's postponed weight passes fill the time until it needs them)."""
    orders = zero_bubble_compute_order(num_stages, num_microbatches)
    what = f"ZB-H1 ({num_stages} stages, {num_microbatches} micro-batches)"
    return lower(orders, range(num_stages), ReceiveAt.PRODUCED, what, skips)
