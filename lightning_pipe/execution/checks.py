"""What the interpreter checks of the values a stage and the head produce, each refusal naming the
stage and micro-batch: NaN or Inf (when asked to), a loss that is not a scalar, and a stage output
that requires grad without a path back to anything (a gradient sent for it would reach no
parameter)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_pipe.execution.activation import Activation, as_tuple


def check_finite(value: Activation, where: str) -> None:
    """Raise ``FloatingPointError`` naming ``where`` if ``value`` holds NaN or Inf."""
    for k, t in enumerate(as_tuple(value)):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            part = f" (tensor {k})" if isinstance(value, tuple) else ""
            raise FloatingPointError(f"NaN or Inf first appeared in {where}{part}.")


def check_loss(value: Any, i: int) -> None:
    """A training head must return micro-batch ``i``'s loss as a scalar tensor."""
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise TypeError(f"The loss of micro-batch {i} must be a scalar tensor, got {got}.")


def check_grad_paths(out: Activation, s: int, own_leaves: Iterable[torch.Tensor]) -> None:
    """Every output of stage ``s`` that requires grad has a path back: a graph, a parameter, or
    one of the stage's ``own_leaves`` (its received input, a popped skip) passed on, whose
    gradient comes back to it like any root's."""
    received = {id(t) for t in own_leaves}
    for k, t in enumerate(as_tuple(out)):
        if (
            t.requires_grad
            and t.grad_fn is None
            and not isinstance(t, nn.Parameter)
            and id(t) not in received
        ):
            raise RuntimeError(
                f"Output {k} of pipeline stage {s} requires grad but has no grad path: it is "
                "a new leaf tensor, so gradients sent back for it would reach no "
                "parameter. Compute it from the stage input or parameters, or detach() it."
            )
