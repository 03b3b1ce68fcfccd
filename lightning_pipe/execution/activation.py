"""An activation as the interpreter handles it: its tensors as a tuple, leaves that stand for it
(its data without its graph), and whether a gradient travels back for one of its tensors."""

from __future__ import annotations

import torch

from lightning_pipe.execution.layers import Activation


def as_tuple(value: Activation) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def stand_in(value: Activation) -> Activation:
    """Leaves with ``value``'s data, grad-requirement and Python attributes (a tensor-parallel
    head's vocabulary tag, which the loss reads), without its graph."""
    if isinstance(value, tuple):
        return tuple(leaf(t) for t in value)
    return leaf(value)


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data as a new leaf, with its grad-requirement and Python attributes."""
    new = tensor.detach().requires_grad_(tensor.requires_grad)
    for name, attribute in vars(tensor).items():
        setattr(new, name, attribute)
    return new


def carries_grad(tensor: torch.Tensor) -> bool:
    """Whether a gradient travels back for a skip's tensor (as ``TensorMeta.carries_grad``)."""
    return tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())
