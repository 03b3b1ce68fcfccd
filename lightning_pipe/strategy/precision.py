"""Precision plugins that clip gradients by the norm over every stage.

Lightning clips through the precision plugin (``Precision.clip_grad_by_norm``), which would take
the norm of this rank's gradients only: each stage would clip by its own norm, unlike one device.
Lightning's own FSDP strategy has its own plugin subclass for the same reason; ``pipe_tp`` does
likewise: each standard plugin Lightning builds from ``Trainer(precision=...)`` is re-created as
the subclass below with the same arguments, and the subclass asks the strategy's runtime for the
global norm. A plugin of another kind is kept as given; clipping under it is refused at setup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

GlobalClip = Callable[[float], torch.Tensor]


class GlobalNormClipping:
    """Mixed in front of a Lightning precision plugin: ``clip_grad_by_norm`` clips by the whole
    model's gradient norm, computed by ``clip_by_global_norm`` (set by the strategy at setup)."""

    clip_by_global_norm: GlobalClip | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_by_global_norm is None:
            raise RuntimeError("The pipe_tp precision plugin clips only after the strategy's setup.")
        self.clip_by_global_norm(float(clip_val))

    # Lightning keeps a plugin's state (an fp16 scaler's) under its class's ``__qualname__``: stored
    # under the Lightning base's name instead, a checkpoint moves between pipe_tp and one device.
    def _base_name(self) -> str:
        base = next(c for c in type(self).__mro__ if c.__module__.startswith("lightning."))
        return base.__qualname__

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if type(self).__qualname__ in checkpoint:
            checkpoint[self._base_name()] = checkpoint.pop(type(self).__qualname__)
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._base_name() in checkpoint:
            checkpoint[type(self).__qualname__] = checkpoint[self._base_name()]
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]


class PipeTPPrecision(GlobalNormClipping, Precision):
    """``precision="32-true"``."""


class PipeTPMixedPrecision(GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"`` (and ``"16-mixed"``)."""


class PipeTPHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"`` / ``"16-true"``."""


class PipeTPDoublePrecision(GlobalNormClipping, DoublePrecision):
    """``precision="64-true"``."""


def with_global_clipping(plugin: Precision | None) -> Precision | None:
    """``plugin`` as its ``pipe_tp`` subclass, built with the same arguments (the same scaler,
    if any); a plugin of another kind, or one already converted, is returned unchanged."""
    if plugin is None or isinstance(plugin, GlobalNormClipping):
        return plugin
    kind = type(plugin)
    if kind is Precision:
        return PipeTPPrecision()
    if kind is MixedPrecision:
        mixed: Any = plugin
        return PipeTPMixedPrecision(mixed.precision, mixed.device, mixed.scaler)
    if kind is HalfPrecision:
        return PipeTPHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    if kind is DoublePrecision:
        return PipeTPDoublePrecision()
    return plugin
