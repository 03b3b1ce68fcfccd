"""Where ``PipeTPStrategy`` has to read Lightning's private state, in one place.

Each function names the Lightning behaviour it works around, so that it can be removed when
Lightning changes.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_pipe.strategy.summary import SummaryFactory


def weights_only_of_running_call() -> bool | None:
    """The ``weights_only`` given to the running ``trainer.fit/validate/test/predict`` call.

    A strategy that restores after setup (``restore_checkpoint_after_setup``, as this one must:
    each rank loads only its own stage's part) is asked to load without it: ``Trainer._run`` calls
    ``_restore_modules_and_callbacks(ckpt_path)`` and drops the argument (Lightning 2.6). It is
    still a local of that ``Trainer._run`` frame.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_run" and isinstance(frame.f_locals.get("self"), Trainer):
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame


class _PipelineSummaryCallback:
    """Mixed in front of a ``ModelSummary`` callback's class: its summary comes from the strategy.

    Lightning's ``ModelSummary._summary`` (2.4-2.6) is where it picks ``DeepSpeedSummary`` for
    ZeRO-3; it has no hook for other strategies, so the strategy gives the callback this subclass.
    """

    _pipe_tp_summary: SummaryFactory
    _max_depth: int

    def _summary(self, trainer: Trainer, pl_module: LightningModule) -> ModelSummary:
        return self._pipe_tp_summary(pl_module, self._max_depth)


def use_pipeline_summary(trainer: Trainer, factory: SummaryFactory) -> None:
    """Make every ``ModelSummary``/``RichModelSummary`` callback of ``trainer`` summarise with
    ``factory`` (the callback keeps its identity and options: only its class changes)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, ModelSummaryCallback):
            continue
        if not isinstance(callback, _PipelineSummaryCallback):
            callback.__class__ = _summary_class(type(callback))
        cast(Any, callback)._pipe_tp_summary = factory


_SUMMARY_CLASSES: dict[type, type] = {}


def _summary_class(base: type) -> type:
    if base not in _SUMMARY_CLASSES:
        # Same names as the base: Lightning keys callback state by ``__qualname__``.
        names = {"__qualname__": base.__qualname__, "__module__": base.__module__}
        _SUMMARY_CLASSES[base] = type(base.__name__, (_PipelineSummaryCallback, base), names)
    return _SUMMARY_CLASSES[base]
