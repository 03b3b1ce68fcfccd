"""An activation as the interpreter handles it: its tensors as a tuple, leaves that stand for it
(its data without its graph), and whether a gradient travels back for one of its tensors."""

from __future__ import annotations

import torch

Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What travels between pipeline layers and stages."""


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
    return _with_attributes(tensor.detach().requires_grad_(tensor.requires_grad), tensor)


def copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` inside its graph (the gradient reaches ``tensor`` through it), with its
    Python attributes: what a layer may change in place where ``tensor`` is a leaf."""
    return _with_attributes(tensor.clone(), tensor)


def _with_attributes(new: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    # Attributes a layer attached travel with the tensor (a tensor-parallel head's group tag).
    new.__dict__.update(tensor.__dict__)
    return new


def carries_grad(tensor: torch.Tensor) -> bool:
    """Whether a gradient travels back for a skip's tensor (as ``TensorMeta.carries_grad``)."""
    return tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())
