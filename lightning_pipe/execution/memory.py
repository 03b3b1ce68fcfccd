"""Activation memory metering: how many bytes a rank holds for backward over the micro-batches
alive at once (``PipelineExecutor.measure_activation_memory``).

Two measures per micro-batch of a stage, kept from its forward until its backward frees them:
what autograd saved (counted by a saved-tensor hook that keeps each tensor as it is), and what the
step holds besides (its stage input, output and popped skip tensors, which a layer that only
passes a tensor on never saves). A tensor held by several live micro-batches (a weight kept for
the input gradient) exists once, so the totals count distinct tensors.

Under recomputation a micro-batch keeps its stage input and output only; with a split backward
(zero-bubble) its input-gradient pass runs the forward again, and that replayed graph is held until
the weight pass, which ZB-H1's pipeline rank ``r`` defers by ``r`` micro-batches: counted from the
replay (:meth:`ActivationMeter.add_replayed`) to the weight pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lightning_pipe.execution.activation import as_tuple

Counted = dict[tuple[int, int], int]
"""Distinct tensors, keyed by (data pointer, bytes) -> their bytes."""


def _counting_pack(saved: Counted) -> Callable[[torch.Tensor], torch.Tensor]:
    """A saved-tensor hook that records each distinct saved tensor's bytes and keeps the tensor."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[(tensor.data_ptr(), tensor.nbytes)] = tensor.nbytes
        return tensor

    return pack


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def counting_saved(saved: Counted, on: bool = True) -> AbstractContextManager[None]:
    """Inside the block, every tensor autograd saves is counted into ``saved`` (and kept as is);
    nothing happens when not ``on`` (the hook costs time on every saved tensor)."""
    if not on:
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_counting_pack(saved), _identity)


def _counted(tensors: Iterable[Any]) -> Counted:
    """The distinct tensors among ``tensors`` (other values skipped), as the meter keys them."""
    return {(t.data_ptr(), t.nbytes): t.nbytes for t in tensors if isinstance(t, torch.Tensor)}


def _live(counted: dict[tuple[int, int], Counted]) -> int:
    return sum({k: v for d in counted.values() for k, v in d.items()}.values())


class ActivationMeter:
    """One step's counts per (stage, micro-batch) alive; :meth:`measure` after each forward,
    :meth:`release` when its backward frees it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._saved: dict[tuple[int, int], Counted] = {}
        self._held: dict[tuple[int, int], Counted] = {}
        self.peak_saved = 0
        """The most bytes saved by autograd over the micro-batches alive at once, this step."""
        self.peak_held = 0
        """The same with what the step holds besides (stage inputs, outputs, popped skips)."""

    def _update_peaks(self) -> None:
        self.peak_saved = max(self.peak_saved, _live(self._saved))
        self.peak_held = max(self.peak_held, _live(self._held))

    def measure(
        self,
        key: tuple[int, int],
        saved: Counted,
        kept: Iterable[torch.Tensor],
        recomputed: bool = False,
        stage_input: Any = None,
    ) -> None:
        """Keep micro-batch ``key``'s counts: ``saved`` by autograd in its forward, and the tensors
        ``kept`` until its backward. A ``recomputed`` micro-batch keeps only its ``stage_input``
        (what autograd saved is freed)."""
        if recomputed:  # recomputation keeps only the stage input
            saved = _counted(as_tuple(stage_input))
        self._saved[key] = saved
        self._held[key] = {**saved, **_counted(kept)}
        self._update_peaks()

    def add_replayed(self, key: tuple[int, int], saved: Counted, outputs: Any) -> None:
        """Micro-batch ``key``'s forward ran again for its input gradient (zero-bubble with
        recomputation): what autograd ``saved`` then, and the replay's ``outputs`` (the roots the
        weight pass starts from), are held with it until its weight pass."""
        self._saved[key] = {**self._saved.get(key, {}), **saved}
        self._held[key] = {**self._held.get(key, {}), **saved, **_counted(as_tuple(outputs))}
        self._update_peaks()

    def release(self, key: tuple[int, int]) -> None:
        """Micro-batch ``key``'s backward freed what it held."""
        self._saved.pop(key, None)
        self._held.pop(key, None)
