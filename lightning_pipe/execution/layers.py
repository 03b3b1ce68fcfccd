"""A stage's layers applied in order: what a pipeline stage computes, and the one contract its
layers keep (a tensor, or a tuple of tensors that becomes the next layer's positional arguments).

A layer is usually called as ``layer(*x)``. A model whose layers take other arguments (a Hugging
Face decoder layer wants ``attention_mask=`` and ``position_embeddings=``, rebuilt on each stage
from what travels) gives each such layer a :data:`LayerCall`; :func:`bind_layers` wraps the layer
with it in a :class:`BoundLayer`, which the executor runs like any layer. The layer itself stays
what the partition, the checkpoints and tensor-parallel slicing see: the call holds no parameters.

A stage's input arrives from the previous stage as a leaf tensor that requires a gradient (its
gradient is what the stage sends back), and autograd refuses to change a leaf in place, where one
device's model hands the layer a tensor computed by the previous layer. So a layer known to change
its input in place (torch's activations and dropouts with ``inplace=True``, alone or first in an
``nn.Sequential``) is handed a copy of such a leaf: exact, one copy of the stage input per micro-
batch, only there. Any other layer that changes a leaf input in place stops with
:class:`InPlaceInputError` naming the layer and the fix (it cannot be called again: it may have
drawn random numbers or updated buffers before the change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_pipe.execution.activation import Activation, as_tuple, copied
from lightning_pipe.execution.seeding import seeded

LayerCall = Callable[[nn.Module, tuple[Any, ...]], Activation]
"""How one pipeline layer is applied: ``call(layer, args)`` with the previous layer's output as a
tuple of positional arguments; returns this layer's output (the default is ``layer(*args)``)."""


class BoundLayer(nn.Module):
    """A pipeline layer applied by its :data:`LayerCall`; the layer is its only child, so its
    parameters and buffers are the layer's (what backward, recomputation and BatchNorm look at)."""

    def __init__(self, layer: nn.Module, call: LayerCall) -> None:
        super().__init__()
        self.layer = layer
        self.call = call

    def forward(self, *args: Any) -> Activation:
        return self.call(self.layer, args)


def bind_layers(layers: Sequence[nn.Module], calls: Sequence[LayerCall | None] | None) -> list[nn.Module]:
    """``layers`` as the executor runs them: each with a call wrapped in a :class:`BoundLayer`."""
    if calls is None:
        return list(layers)
    if len(calls) != len(layers):
        raise ValueError(f"{len(calls)} layer calls were given for {len(layers)} pipeline layers.")
    return [
        layer if call is None else BoundLayer(layer, call) for layer, call in zip(layers, calls, strict=True)
    ]


def apply_layers(
    layers: Sequence[nn.Module], x: Any, stage_index: int = 0, seeds: Sequence[int] | None = None
) -> Activation:
    """Apply ``layers`` in order; a tuple output becomes the next layer's positional arguments.

    ``seeds``: one per layer, from which that layer draws its random numbers (layer-seeded
    dropout, :mod:`~lightning_pipe.execution.seeding`); ``None``: the program's own streams.
    """
    for position, layer in enumerate(layers):
        if _changes_input_in_place(layer) and torch.is_grad_enabled():
            x = _copy_leaves(x)
        try:
            with seeded(seeds[position], _device_of(x)) if seeds is not None else nullcontext():
                y = layer(*x) if isinstance(x, tuple) else layer(x)
        except RuntimeError as e:
            if isinstance(e, InPlaceInputError) or _LEAF_IN_PLACE not in str(e) or not _has_leaf(x):
                raise
            raise InPlaceInputError(
                f"Layer {position} ({type(layer).__name__}) of pipeline stage {stage_index} changed "
                "its input in place. Its input is the stage's input, which arrives from the previous "
                "stage as a leaf tensor that requires grad, and autograd refuses to change a leaf in "
                "place (one device hands the layer the previous layer's output instead). Make the "
                "operation out of place (`x = x + y` instead of `x += y`, `inplace=False`), start the "
                "stage at another layer (partition=[...]), or give the layer an attribute "
                "`inplace = True`: pipe_tp then hands it a copy of the stage's input."
            ) from e
        x = y
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


class InPlaceInputError(RuntimeError):
    """A stage's layer changed the stage's input, a leaf that requires grad, in place."""


_LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"
"""autograd's refusal (its text since torch 1.x)."""


def _changes_input_in_place(layer: nn.Module) -> bool:
    """Whether ``layer`` is known to change its input in place: a module with ``inplace=True``
    (torch's activations and dropouts), alone, bound to a call, or first in an ``nn.Sequential``."""
    while True:
        if isinstance(layer, BoundLayer):
            layer = layer.layer
        elif isinstance(layer, nn.Sequential) and len(layer) > 0:
            layer = layer[0]
        else:
            return getattr(layer, "inplace", False) is True


def _is_grad_leaf(t: Any) -> bool:
    """A leaf tensor that requires grad: what autograd refuses to let a layer change in place."""
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def _has_leaf(x: Any) -> bool:
    return any(_is_grad_leaf(t) for t in as_tuple(x))


def _copy_leaves(x: Any) -> Any:
    """``x`` with each leaf that requires grad replaced by a copy, which autograd lets a layer
    change in place (the gradient reaches the leaf through the copy)."""
    tensors = tuple(copied(t) if _is_grad_leaf(t) else t for t in as_tuple(x))
    return tensors if isinstance(x, tuple) else tensors[0]


def _device_of(x: Any) -> torch.device:
    first = x[0] if isinstance(x, tuple) and x else x
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block (what a served model runs: dropout draws nothing, a
    BatchNorm accumulates nothing; the checks that run layers on a probe use it), every module's
    own mode back after it."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
