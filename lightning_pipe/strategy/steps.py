"""Lightning's step hooks over one engine call: the user's step as the pipeline's head.

Lightning calls ``training_step`` (``validation_step``, ...) once per batch. Here that call is one
:meth:`~lightning_pipe.runtime.ParallelRuntime.train_batch` (or ``eval_batch``) whose head,
:class:`LightningHead`, runs the user's step on the last stage once per micro-batch with
``self(...)`` returning the pipeline output, captures what it logs, and gives the engine, as its
``results()``, the logged values, the metrics' states and the predictions, which every rank of
the pipeline receives back and replays, so that Lightning's loops continue identically everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.batches.agreement import StepIdentity
from lightning_pipe.batches.microbatch import batch_size
from lightning_pipe.checkpoint.full import to_cpu
from lightning_pipe.runtime import Microbatch, ParallelRuntime, TimelineRecorder
from lightning_pipe.strategy.context_logs import whole_over_context
from lightning_pipe.strategy.log_capture import (
    BatchMetrics,
    LogCapture,
    capturing,
    load_metric_states,
    metric_states,
    replay,
)
from lightning_pipe.strategy.outputs import concat_outputs, forward_returns
from lightning_pipe.strategy.pipeline_model import Redirect


class LightningHead:
    """The end of each micro-batch on the last stage: the user's ``step_name`` with ``self(...)``
    returning the pipeline output; ``results()`` gives what every rank must replay."""

    def __init__(
        self, module: LightningModule, step_name: str, rest: Sequence[Any], training: bool, redirect: Redirect
    ) -> None:
        self.module, self.step_name, self.rest, self.training = module, step_name, tuple(rest), training
        self.redirect = redirect
        self.capture = LogCapture()
        self.metrics: BatchMetrics | None = None
        """The metrics' batch-level step values, while the last stage runs the step."""
        self.outputs: dict[int, Any] = {}
        self.batch_samples = 0
        """The batch's samples (what its logged values count as, for epoch averages)."""

    def __call__(self, output: Any, microbatch: Microbatch) -> Any:
        self.capture.microbatch_weight = microbatch.share * self.batch_samples
        target, reply, call = self.redirect(microbatch, output)
        with forward_returns(target, reply, f"{type(self.module).__name__}.{self.step_name}", call):
            value = getattr(self.module, self.step_name)(microbatch.data, *self.rest)
        if not self.training:
            self.outputs[microbatch.index] = value
            return value
        loss = value.get("loss") if isinstance(value, dict) else value
        if loss is None:
            raise MisconfigurationException(
                f"training_step returned None for micro-batch {microbatch.index} of batch "
                f"{self.module.trainer.fit_loop.epoch_loop.batch_idx} (to skip the batch, as on one device). "
                "Under pipe_tp the other stages have already run this micro-batch and wait for its gradient, "
                "so a batch cannot be skipped from inside training_step. Instead, drop such samples "
                "before they reach the model (in the Dataset, a collate_fn or the DataLoader's sampler), "
                "or return a zero loss (`return loss * 0.0`: no gradient, but the optimizer still steps, "
                "so momentum and Adam still move weights)."
            )
        if not isinstance(loss, torch.Tensor):
            raise MisconfigurationException(
                f"training_step must return the loss tensor (or a dict with a 'loss' key) for every "
                f"micro-batch under pipe_tp, got {type(value).__name__} for micro-batch {microbatch.index}."
            )
        return loss

    def results(self) -> dict[str, Any]:
        """What every rank of the pipeline replays: logged values, metric states, predictions."""
        if self.metrics is not None:  # the batch's metric values first: their states travel
            self.metrics.finish()
        records = list(self.capture.records.values())
        out: dict[str, Any] = {"records": records, "metrics": metric_states(self.module, records)}
        if self.step_name == "predict_step":
            out["predictions"] = to_cpu(concat_outputs([self.outputs[i] for i in sorted(self.outputs)]))
        return out


def run_step(
    module: LightningModule,
    runtime: ParallelRuntime,
    step_name: str,
    args: tuple[Any, ...],
    reduce: Callable[..., Any],
    redirect: Redirect,
    *,
    final: bool = False,
    loss_weight: float = 1.0,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    recorder: TimelineRecorder | None = None,
    prepare: Callable[[str, tuple[Any, ...]], None] | None = None,
) -> Any:
    """One engine call for Lightning's ``step_name`` of the batch ``args[0]``; returns what the
    step returns on every rank (the loss tensor when training, the predictions when predicting).
    ``prepare(step_name, args)`` runs first, on every rank (a derived pipeline learns there which
    batch tensors the step gives the model)."""
    if prepare is not None:
        prepare(step_name, args)
    trainer = module.trainer
    training = step_name == "training_step"
    batch, rest = args[0], args[1:]
    if training:
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    else:
        batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
    head = LightningHead(module, step_name, rest, training, redirect)
    head.batch_samples = batch_size(batch)
    last = runtime.holds_last_stage
    with ExitStack() as stack:
        if last:
            stack.enter_context(capturing(trainer, head.capture))
            head.metrics = BatchMetrics(module)
            stack.callback(head.metrics.remove)
        step = StepIdentity(step_name, batch_idx)
        if training:
            result = runtime.train_batch(
                batch, head, final=final, loss_weight=loss_weight, step=step, scale_loss=scale_loss,
                recorder=recorder, training_batch=trainer.fit_loop.total_batch_idx,
            )  # fmt: skip
        else:
            result = runtime.eval_batch(batch, head, step=step, recorder=recorder)
    device = runtime.device
    context_group = runtime.mesh.context_group
    if context_group is not None:  # each rank's part's values made the whole sequences'
        whole_over_context(
            result.results["records"], result.items, head.batch_samples, context_group,
            runtime.mesh.layout.context_parallel_size, device,
        )  # fmt: skip
    load_metric_states(module, result.results["metrics"], device)
    replicated = runtime.mesh.layout.data_parallel_size == 1
    replay(trainer, module, result.results["records"], reduce, device, replicated)
    if training:
        assert result.device_loss is not None
        return result.device_loss.to(device=device, dtype=torch.float32)
    return result.results.get("predictions")
