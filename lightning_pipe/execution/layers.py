"""A stage's layers applied in order: what a pipeline stage computes, and the one contract its
layers keep (a tensor, or a tuple of tensors that becomes the next layer's positional arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What travels between pipeline layers and stages."""


def apply_layers(layers: Sequence[nn.Module], x: Any, stage_index: int = 0) -> Activation:
    """Apply ``layers`` in order; a tuple output becomes the next layer's positional arguments."""
    for position, layer in enumerate(layers):
        x = layer(*x) if isinstance(x, tuple) else layer(x)
        if not (
            isinstance(x, torch.Tensor)
            or (isinstance(x, tuple) and x and all(isinstance(t, torch.Tensor) for t in x))
        ):
            raise TypeError(
                f"Layer {position} ({type(layer).__name__}) of pipeline stage {stage_index} returned "
                f"{type(x).__name__}; a pipeline layer must return a tensor or a non-empty tuple of "
                "tensors (wrap other values in tensors, or move them into the batch)."
            )
    return x
