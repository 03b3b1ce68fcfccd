"""Precision plugins that clip gradients by the norm over every stage.

Lightning clips through the precision plugin (``Precision.clip_grad_by_norm``), which would take
the norm of this rank's gradients only: each stage would clip by its own norm, unlike one device.
Lightning's own FSDP strategy has its own plugin subclass for the same reason; ``pipe_tp`` does
likewise: each standard plugin Lightning builds from ``Trainer(precision=...)`` is re-created as
the subclass below with the same arguments, and the subclass asks the strategy's runtime for the
global norm. A plugin of another kind is kept as given; clipping under it is refused at setup.

The strategy's setup checks here what the precision allows (:func:`check_precision`), and, once
the optimizers exist, installs the global clipping and fp16's agreed gradient scaler, refusing
what fp16 cannot agree over the stages (:func:`install_global_clipping`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_pipe.runtime import AgreedGradScaler, GradientSharding, ParallelRuntime

GlobalClip = Callable[[float], torch.Tensor]
SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


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


def check_precision(plugin: Precision) -> None:
    """Refuse, at setup, a precision the strategy does not train with."""
    precision = str(getattr(plugin, "precision", "32-true"))
    if precision not in SUPPORTED_PRECISION:
        raise MisconfigurationException(
            f"precision={precision!r} is not supported by the pipe_tp strategy yet; use one of "
            f"{list(SUPPORTED_PRECISION)} (for 16-bit training on GPUs, 'bf16-mixed')."
        )


def install_global_clipping(
    trainer: Trainer,
    plugin: Precision,
    optimizers: list[Any],
    runtime: ParallelRuntime,
    model_group: Any,
    root_device: torch.device,
    clip: GlobalClip,
) -> None:
    """At setup, once the optimizers exist: refuse what fp16 cannot agree over the stages (a fused
    optimizer, sharded gradients), make fp16's scaler skip or step on every rank of the model
    (``model_group``) together, and hand ``plugin`` the global-norm ``clip`` (a plugin that cannot
    take it is refused when the Trainer clips by norm)."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        fused = [type(o).__name__ for o in optimizers if getattr(o, "_step_supports_amp_scaling", False)]
        if fitting and fused:
            # Such an optimizer unscales inside its own step, where no rank can agree the check.
            raise MisconfigurationException(
                f'precision="16-mixed" under pipe_tp agrees the gradient scaler\'s inf check over every '
                f"stage before stepping, which the fused optimizer(s) {fused} bypass (they unscale "
                "inside their own step). Use the optimizer without fused=True, or precision='bf16-mixed'."
            )
        if fitting and runtime.gradient_sharding is GradientSharding.PARAMETERS:
            raise MisconfigurationException(
                'precision="16-mixed" with shard_parameters=True is not supported yet: each '
                "data-parallel rank holds only its shards of the gradients, and the gradient "
                "scaler's inf check would have to be agreed over the data axis too. Use "
                'precision="bf16-mixed" (parameters gathered in bfloat16) or "32-true", or '
                "shard_parameters=False."
            )
        if fitting and runtime.gradient_sharding is GradientSharding.OPTIMIZER_STATE:
            raise MisconfigurationException(
                'precision="16-mixed" with shard_optimizer_state=True is not supported yet: each '
                "replica holds only its slice of the gradients, and the gradient scaler's inf check "
                'would have to be agreed over the replicas too. Use precision="bf16-mixed" or '
                '"32-true", or shard_optimizer_state=False.'
            )
        # fp16: every rank of the model skips or steps together (runtime/grad_scaler.py).
        if not isinstance(plugin.scaler, AgreedGradScaler):
            device = root_device.type
            plugin.scaler = AgreedGradScaler.like(plugin.scaler, device, model_group)
        else:
            plugin.scaler.group = model_group
    if isinstance(plugin, GlobalNormClipping):
        plugin.clip_by_global_norm = clip
    elif fitting and trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "norm":
        raise MisconfigurationException(
            f"gradient_clip_val={trainer.gradient_clip_val} under pipe_tp clips by the norm over every "
            f"stage, which the precision plugin {type(plugin).__name__} cannot do (it would clip each "
            "stage by its own norm, unlike one device). Use Trainer(precision=...) with one of "
            f"{list(SUPPORTED_PRECISION)}, or clip inside the model."
        )


def loss_scaler(plugin: Precision) -> Any:
    """fp16's loss scaling (the precision plugin's gradient scaler), else ``None``."""
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    return scaler.scale if scaler is not None else None
