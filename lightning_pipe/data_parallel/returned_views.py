"""Views that FSDP2 units return: copied before FSDP2 hooks them, so a change in place is safe.

A unit's forward often returns a view: a ``Linear`` with a bias over a 3-d input returns one, as
does ``x.view(...)``. FSDP2 registers the hook that gathers the unit's parameters again for its
backward on that output, and an in-place operation on a view (``out += y``, ``out.mul_(2)``,
``ReLU(inplace=True)``) replaces the view's place in the autograd graph, dropping the hook. torch
(2.13) warns about it on every run; under ``pipe_tp`` the outputs go to places where it happens:

* a layer without parameters (no unit of its own) that changes its input in place, after a
  layer's unit. Tried at dp=2 against one process: with ``reshard_after_forward=True`` two such
  pairs in a row (``Linear, ReLU(inplace=True), Linear, ReLU(inplace=True)``), or one after each
  unit of a stage, made the backward run on freed parameters, which failed deep in autograd
  ("setStorage: ... out of bounds for storage of size 0"), in one stage and at pp=2 (one such pair
  alone in a stage trained correctly). With ``False`` (the default with a pipeline) the
  parameters stay gathered through the step and the gradients were one process's;
* the loss, changing the last stage's output in place: the same failure with resharding.

So every unit ``pipe_tp`` makes (each layer's, each stage root's, each block of experts') gets a
forward hook, run before FSDP2's own, that replaces each view among its output tensors needing a
gradient by a copy (:func:`copy_returned_views`). FSDP2 then hooks a tensor that is no view, whose
hooks an in-place change keeps (they receive the gradient of the value before the change, as
torch documents), and does not warn. The copy is exact and costs one copy of that output per
forward while gradients are on; outputs that are no views (most layers' last operation makes a new
tensor) are passed on untouched. Views inside containers other than tuples, lists and dicts (a
dataclass) are left as they are, and FSDP2 still warns about them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_MARK = "_pipe_tp_copies_views"


def copy_returned_views(module: nn.Module) -> None:
    """Copy the views among ``module``'s output tensors needing a gradient, while gradients are on,
    before any forward hook registered earlier (FSDP2's) sees them. Once per module."""
    if getattr(module, _MARK, False):
        return
    module.register_forward_hook(_copy_views, prepend=True)
    setattr(module, _MARK, True)


def _copy_views(module: nn.Module, args: Any, output: Any) -> Any:
    if not torch.is_grad_enabled():
        return None  # no backward to break (evaluation): the output as it is
    return without_views(output)


def without_views(value: Any) -> Any:
    """``value`` with each view that needs a gradient replaced by a copy (with the view's Python
    attributes), through tuples (named ones too), lists and dicts; everything else as it is."""
    if isinstance(value, torch.Tensor):
        if not (value.requires_grad and value._base is not None):
            return value
        copy = value.clone()
        # What the layer attached to its output travels with it (vocab-parallel logits carry their
        # tensor-parallel group: tensor_parallel.cross_entropy).
        copy.__dict__.update(value.__dict__)
        return copy
    if isinstance(value, tuple):
        items = [without_views(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [without_views(v) for v in value]
    if type(value) is dict:
        return {k: without_views(v) for k, v in value.items()}
    return value
