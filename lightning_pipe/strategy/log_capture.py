"""Make ``self.log`` symmetric under pipeline parallelism.

The user's step runs on the last stage only, once per micro-batch, yet every rank must end with
the same ``trainer.callback_metrics`` as one device: ModelCheckpoint, EarlyStopping and the
progress bar read them on every rank, and a rank that disagrees hangs or diverges.

So while the pipeline runs, the last stage's ``self.log`` calls go to a :class:`LogCapture` in
place of the loop's result collection. Afterwards the last stage reduces them to one record per
key (the mean over micro-batches weighted by their shares of the batch's loss: one value for the
whole batch, as one device logs it), sends the records and the state of every logged torchmetrics
``Metric`` to the other ranks of its pipeline, and *every* rank replays the records into its real
result collection. From there on Lightning's own machinery (on_step/on_epoch accumulation,
``sync_dist`` through ``strategy.reduce`` over the data-parallel group, epoch-end
``Metric.compute``) runs the same way on all ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torchmetrics import Metric

import lightning_pipe.strategy.compat as compat


@dataclass
class LoggedValue:
    """Everything one ``results.log`` call needs, reduced over micro-batches and picklable."""

    fx: str
    name: str
    options: dict[str, Any]
    """Keyword arguments of ``_ResultCollection.log`` except the value and ``sync_dist_fn``."""
    metric_attribute: str | None = None
    weighted_sum: torch.Tensor | float = 0.0
    """The values times their weights, summed in float64 on the device (never read by the host
    during the step: it reaches the other ranks and Lightning as a tensor)."""
    weight: float = 0.0

    @property
    def value(self) -> torch.Tensor | float:
        return self.weighted_sum / self.weight


@dataclass
class LogCapture:
    """Stands in for the loop's ``_ResultCollection`` while the last stage runs its steps."""

    microbatch_weight: float = 0.0
    """The running micro-batch's weight in the batch's logged values: its share of the batch's
    loss (of its samples, or of its tokens when the loss is a mean over tokens) times the batch's
    samples, so that the weights add up to the batch size Lightning averages epochs by."""
    records: dict[tuple[str, str], LoggedValue] = field(default_factory=dict)

    def log(self, fx: str, name: str, value: Any, **options: Any) -> None:
        options.pop("sync_dist_fn", None)  # a bound strategy method: re-attached on replay
        metric_attribute = options.pop("metric_attribute", None)
        user_batch_size = options.pop("batch_size", None)
        record = self.records.get((fx, name))
        if record is None:
            record = LoggedValue(fx, name, options, metric_attribute)
            self.records[(fx, name)] = record
        if isinstance(value, Metric):
            return  # its state travels whole; see metric_states()
        weight = float(user_batch_size if user_batch_size is not None else self.microbatch_weight)
        # float64 on the device: what summing Python floats computed, without reading each value.
        record.weighted_sum = record.weighted_sum + torch.as_tensor(value).detach().double() * weight
        record.weight += weight
        record.options["batch_size"] = round(record.weight)

    def reset(self, *args: Any, **kwargs: Any) -> None:
        """Lightning resets tensors on the first log of a hook; the replay does that for real."""


@contextmanager
def capturing(trainer: Any, capture: LogCapture | None) -> Iterator[None]:
    """Route ``self.log`` to ``capture`` during the pipeline (no-op for ``None``)."""
    if capture is None:
        yield
        return
    with compat.results_replaced_by(trainer, capture):
        yield


class BatchMetrics:
    """Make each torchmetrics ``Metric``'s step value that of the whole batch, not the last micro-batch.

    Logging a Metric with ``on_step=True`` reports ``metric._forward_cache``, the value ``forward``
    computed on its last input: under micro-batching, the last micro-batch. While installed, every
    ``forward`` also updates a fresh copy of the metric; :meth:`finish` makes the copy's value over
    all the batch's micro-batches the forward cache, which is what one device computes. It must
    run before the metrics' states are sent to the other ranks.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.copies: dict[int, Metric] = {}  # made on a metric's first forward of the step

        def update_copy(metric: Metric, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._copy(metric).update(*args, **kwargs)

        # A forward pre-hook sees every input the metric's forward gets (public nn.Module API). A
        # plain function, not a bound method: cloning a metric deep-copies its hooks, and a bound
        # method would copy this object with the whole module.
        self._handles = [
            metric.register_forward_pre_hook(update_copy, with_kwargs=True)
            for metric in module.modules()
            if isinstance(metric, Metric)
        ]

    def _copy(self, metric: Metric) -> Metric:
        if id(metric) not in self.copies:
            group, metric.process_group = metric.process_group, None  # a ProcessGroup cannot be copied
            try:
                copy = metric.clone()
            finally:
                metric.process_group = group
            copy.reset()
            # This batch's value, from this replica's data only: no collective in its compute().
            compat.never_sync(copy)
            self.copies[id(metric)] = copy
        return self.copies[id(metric)]

    def finish(self) -> None:
        """Set every updated metric's step value to its batch-level value; stop watching."""
        self.remove()
        for metric in self.module.modules():
            if isinstance(metric, Metric) and id(metric) in self.copies:
                compat.set_metric_step_value(metric, self.copies[id(metric)].compute())
        self.copies = {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def metric_states(module: torch.nn.Module, records: list[LoggedValue]) -> dict[str, Any]:
    """The state of every Metric logged in ``records``, for sending (its tensors as they are)."""
    states: dict[str, Any] = {}
    for record in records:
        attr = record.metric_attribute
        if attr is None or attr in states:
            continue
        metric = module.get_submodule(attr)
        if not isinstance(metric, Metric):
            raise TypeError(f"{attr!r} was logged as a torchmetrics Metric but is a {type(metric).__name__}.")
        # The tensors as they are (on the device): the results' broadcast sends them as tensors.
        state = {k: (list(v) if isinstance(v, list) else v) for k, v in metric.metric_state.items()}
        states[attr] = (state, compat.metric_update_count(metric), compat.metric_step_value(metric))
    return states


def load_metric_states(module: torch.nn.Module, states: dict[str, Any], device: torch.device) -> None:
    """Give this rank's copies of the logged metrics the last stage's state."""
    for attr, (state, update_count, cache) in states.items():
        metric: Any = module.get_submodule(attr)
        for key, value in state.items():
            if isinstance(value, list):
                setattr(metric, key, [t.to(device) for t in value])
            else:
                setattr(metric, key, value.to(device))
        compat.restore_metric_counts(
            metric, update_count, cache.to(device) if isinstance(cache, torch.Tensor) else cache
        )


def replay(
    trainer: Any,
    module: torch.nn.Module,
    records: list[LoggedValue],
    reduce_fn: Callable[..., Any],
    device: torch.device,
    replicated: bool = False,
) -> None:
    """Log ``records`` into the active loop's real result collection, as ``LightningModule.log`` would.

    ``replicated``: every rank of the job holds these very values (one data-parallel replica):
    they are logged as synced, with a reduction that returns them unchanged, so that Lightning
    neither communicates nor recommends ``sync_dist=True`` for epoch-level values. With several
    replicas the user's ``sync_dist`` applies, as under DDP.
    """
    results = compat.result_collection(trainer)
    if results is None:
        return
    for record in records:
        compat.reset_before_first_log(trainer, results, record.fx)
        if record.metric_attribute is not None:
            value: Any = module.get_submodule(record.metric_attribute)
        else:
            value = torch.as_tensor(record.value).to(device=device, dtype=torch.get_default_dtype())
        options = {**record.options, "sync_dist": True} if replicated else record.options
        results.log(
            record.fx,
            record.name,
            value,
            sync_dist_fn=_unchanged if replicated else reduce_fn,
            metric_attribute=record.metric_attribute,
            **options,
        )
        compat.mark_logged(trainer, record.fx)


def _unchanged(value: Any, group: Any = None, reduce_op: Any = None) -> Any:
    """The reduction of a value every rank already holds."""
    return value
