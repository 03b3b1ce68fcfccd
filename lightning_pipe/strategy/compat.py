"""Every place where ``PipeTPStrategy`` touches Lightning's or torchmetrics' private state.

A strategy that runs forward and backward of all micro-batches inside one ``training_step`` has
no public hook for some things Lightning's loops do around a step (zeroing gradients, backward,
accumulation, logging), so it reaches into them here, and only here. Each function says what it
works around and since which version it holds; the package declares ``lightning>=2.4`` and CI
runs a smoke subset against 2.4 and the suite against the newest release, so a change in one of
these shows up as a failing test that points here.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torchmetrics import Metric

from lightning_pipe.strategy.summary import SummaryFactory


# ------------------------------------------------------------------ processes (Lightning 2.4-2.6)
def launcher(strategy: Any, start_method: str) -> Any:
    """The launcher ``DDPStrategy`` would configure (``_SubprocessScriptLauncher`` re-runs the
    script, ``_MultiProcessingLauncher`` spawns or forks): this strategy derives from
    ``ParallelStrategy``, which has none, so it builds the same ones."""
    if start_method == "popen":
        return _SubprocessScriptLauncher(
            strategy.cluster_environment, strategy.num_processes, strategy.num_nodes
        )
    return _MultiProcessingLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]


def init_process_group(
    cluster_environment: Any, backend: str, timeout: timedelta | None, device: torch.device
) -> None:
    """``torch.distributed.init_process_group`` from the cluster environment, as Lightning's
    strategies do it (``lightning.fabric.utilities.distributed._init_dist_connection``; a no-op
    when a group exists); NCCL is bound to this rank's device."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_backend(device: torch.device) -> str:
    """Lightning's default backend for a device: NCCL on CUDA, gloo otherwise."""
    return str(_get_default_process_group_backend_for_device(device))


def set_rank_zero(rank: int) -> None:
    """Tell Lightning's ``rank_zero_*`` helpers this process's global rank (``DDPStrategy``'s
    ``set_world_ranks`` does it the same way), and say Lightning's per-rank checkpoint notice once."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]
    notices = logging.getLogger(_CHECKPOINT_CONNECTOR_LOGGER)
    if not any(isinstance(f, _OnRankZero) for f in notices.filters):
        notices.addFilter(_OnRankZero())


_CHECKPOINT_CONNECTOR_LOGGER = "lightning.pytorch.trainer.connectors.checkpoint_connector"
_WEIGHTS_ONLY_NOTICE = "`weights_only` was not set"


class _OnRankZero(logging.Filter):
    """``trainer.save_checkpoint(path)`` without ``weights_only`` logs "`weights_only` was not
    set, defaulting to `False`." with ``log.info`` (not ``rank_zero_info``) in
    ``_CheckpointConnector.dump_checkpoint`` (Lightning 2.5-2.6), before the strategy is asked
    anything; under pipe_tp every rank saves, so every rank printed it. Python's logging filter
    keeps it on global rank 0, as one device prints it (what it says holds: the whole state is
    saved)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_WEIGHTS_ONLY_NOTICE):
            return True
        return getattr(rank_zero_only, "rank", 0) == 0


# ------------------------------------------------------------------ the training step (Lightning 2.4-2.6)
def skip_closure_backward(trainer: Trainer) -> None:
    """Automatic optimization's closure runs ``training_step``, then zero-grad and backward; the
    executor has already run backward for every micro-batch by then, so both are switched off
    with the loop's own flag (``_AutomaticOptimization._skip_backward``, used by Lightning for
    steps that return ``None``). The strategy zeroes gradients itself at the start of each
    accumulation window."""
    trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward = True


def should_accumulate(trainer: Trainer) -> bool:
    """Whether this batch is not the last of its accumulation window, as the fit loop decides it
    (``_FitLoop._should_accumulate``): only the last batch's backward may overlap the
    data-parallel all-reduce."""
    return bool(trainer.fit_loop._should_accumulate())


def run_hooks(trainer: Trainer, name: str, *args: Any, callbacks: bool = True) -> None:
    """Run the callbacks' and then the LightningModule's hook ``name`` exactly as the loop does
    (profiled, with Lightning's ``_current_fx_name`` set for ``self.log``):
    ``trainer.call._call_callback_hooks`` and ``_call_lightning_module_hook``. Used for the
    zero-grad and after-backward hooks, which the closure would have run."""
    if callbacks:
        call._call_callback_hooks(trainer, name, *args)
    call._call_lightning_module_hook(trainer, name, *args)


def sync_ddp(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """Lightning's own all-reduce with its ``"mean"``/``"sum"`` names
    (``lightning.fabric.utilities.distributed._sync_ddp_if_available``, 2.0-2.6), as ``DDPStrategy``
    uses it, over a group of our choosing (the data axis)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def optimizers_to_device(optimizers: list[Any], device: torch.device) -> None:
    """Move optimizer state to the device as Lightning's strategies do after loading
    (``lightning.fabric.utilities.optimizer._optimizers_to_device``, 2.0-2.6)."""
    _optimizers_to_device(optimizers, device)


# ------------------------------------------------------------------ logging (Lightning 2.4-2.6)
@contextmanager
def results_replaced_by(trainer: Trainer, stand_in: Any) -> Iterator[bool]:
    """While the pipeline runs, ``self.log`` goes to ``stand_in`` instead of the active loop's
    ``_ResultCollection`` (``loop._results``; the fit loop forwards it to its epoch loop), and the
    logger connector's ``_current_fx`` is restored afterwards, so that the replay decides about
    resets as if nothing had been logged. Yields whether there was a collection to replace."""
    loop: Any = trainer._active_loop
    if loop is None or getattr(loop, "_results", None) is None:
        yield False
        return
    while isinstance(getattr(type(loop), "_results", None), property):
        loop = loop.epoch_loop
    connector = trainer._logger_connector
    real, current_fx = loop._results, connector._current_fx
    loop._results = stand_in
    try:
        yield True
    finally:
        loop._results = real
        connector._current_fx = current_fx


def result_collection(trainer: Trainer) -> Any:
    """The active loop's ``_ResultCollection`` (``Trainer._results``), or ``None``."""
    return trainer._results


def reset_before_first_log(trainer: Trainer, results: Any, fx: str) -> None:
    """What ``LightningModule.log`` does before a hook's first value: reset the hook's tensors
    (``_LoggerConnector.should_reset_tensors``), then mark the hook as current."""
    connector = trainer._logger_connector
    if connector.should_reset_tensors(fx):
        results.reset(metrics=False, fx=fx)


def mark_logged(trainer: Trainer, fx: str) -> None:
    trainer._logger_connector._current_fx = fx


# ------------------------------------------------------------------ torchmetrics (1.x)
def metric_step_value(metric: Metric) -> Any:
    """What logging a Metric ``on_step`` reports: ``Metric._forward_cache``, the value of its last
    ``forward``."""
    return metric._forward_cache


def set_metric_step_value(metric: Metric, value: Any) -> None:
    metric._forward_cache = value


def metric_update_count(metric: Metric) -> int:
    """How many updates a Metric has seen (``Metric._update_count``): ``compute()`` warns at 0."""
    return int(metric._update_count)


def restore_metric_counts(metric: Metric, update_count: int, step_value: Any) -> None:
    """After copying another rank's state into ``metric``: its update count, its step value, and no
    stale ``compute()`` cache (``_update_count``, ``_forward_cache``, ``_computed``)."""
    metric._update_count = update_count
    metric._computed = None
    metric._forward_cache = step_value


def never_sync(metric: Metric) -> None:
    """A per-batch copy of a Metric must not all-reduce in ``compute()``: ``sync_on_compute`` is
    public, ``_to_sync`` (set by ``forward``) is not."""
    metric.sync_on_compute = False
    metric._to_sync = False


def load_checkpoint_file(
    load: Callable[..., dict[str, Any]], path: Any, weights_only: bool | None
) -> dict[str, Any]:
    """``Strategy.load_checkpoint`` (Lightning's, for a single file) with ``weights_only`` where it
    takes one: Lightning 2.5 added the argument; 2.4 loads with ``torch.load``'s default."""
    if "weights_only" in inspect.signature(load).parameters:
        return load(path, weights_only=weights_only)
    return load(path)


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
