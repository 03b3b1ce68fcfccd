"""Views that FSDP2 units return: checked where it matters, instead of warned about on every run.

torch's FSDP2 (2.13) warns whenever a unit's forward returns a view, which is common: a ``Linear``
with a bias over a 3-d input returns one, as does ``x.view(...)``. It warns because an in-place
operation on that view (``out += y``, ``out.mul_(2)``) drops the hook that FSDP registered on it,
the one that gathers the unit's parameters again before its backward.

Under ``pipe_tp`` a stage root's output has two consumers, tried (2 processes, dp=2, both
``reshard_after_forward`` settings, against one process):

* the next stage: the executor sends the output and never changes it;
* the loss head: with ``reshard_after_forward=False`` (the default with a pipeline) the stage's
  parameters stay gathered through the step and the gradients were one process's; with ``True``
  the backward ran on freed parameters and failed deep in autograd ("setStorage: ... out of
  bounds for storage of size 0").

So the runtime checks the loss head's case (:func:`output_views`, :func:`check_unchanged`, when
the parameters are resharded after the forward) and stops with the fix, and the warning is
silenced for the stage roots (:func:`silence_view_warning`), whose output goes only to those two.
It stays for the layers' units: an in-place layer without parameters after one
(``ReLU(inplace=True)``) is rescued only when a later unit of the stage prefetches it, which a
stage's last unit, or the first of two such pairs in a row, lacks (read in torch's source, not
run).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class ChangedOutputError(RuntimeError):
    """The loss changed a view that a fully sharded stage returned, in place."""


def silence_view_warning(modules: Iterable[nn.Module]) -> None:
    """Filter FSDP2's "returned a view tensor" warning for these units (each wrapped by its own
    ``fully_shard`` call), named as torch names them. Adding a filter that is already there moves
    it to the front instead of adding it twice."""
    for module in modules:
        warnings.filterwarnings(
            "ignore",
            message=re.escape(f"FSDP2-wrapped module ({type(module).__name__}) returned a view tensor"),
            category=UserWarning,
        )


def output_views(output: Any) -> list[tuple[int, torch.Tensor, int]]:
    """The views among a stage's output tensors that require a gradient: (position in the
    output, tensor, version)."""
    tensors = output if isinstance(output, tuple) else (output,)
    return [
        (position, t, t._version)
        for position, t in enumerate(tensors)
        if isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None
    ]


def check_unchanged(views: list[tuple[int, torch.Tensor, int]], stage_index: int) -> None:
    """Raise :class:`ChangedOutputError` if the loss changed one of ``views`` in place."""
    for position, tensor, version in views:
        if tensor._version != version:
            raise ChangedOutputError(
                f"The loss changed the output of pipeline stage {stage_index} in place (its tensor "
                f"{position}, a view, e.g. `out += y` or `out.mul_(s)` in training_step or the "
                "loss head). Under shard_parameters=True with reshard_after_forward=True, FSDP2 then "
                "skips gathering the stage's parameters for its backward, and the backward fails. "
                "Use an out-of-place operation (`out = out * s`), or `out = out.clone()` first; or "
                "reshard_after_forward=False."
            )
