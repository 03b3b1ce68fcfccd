"""The steps of ``PipeTPStrategy``: one pipeline schedule per batch, the user's step on the last stage.

Lightning calls ``training_step`` (``validation_step``, ...) once per batch. Here that call splits
the batch into micro-batches, runs the runtime's schedule over them, calls the user's step on the
last stage once per micro-batch with ``self(...)`` returning the pipeline output, captures what it
logs, and hands every rank of the pipeline the same result (loss, logged values, predictions), so
that Lightning's loops continue identically everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.checkpoint.full import to_cpu
from lightning_pipe.pipeline.microbatch import (
    as_layer_arguments,
    batch_size,
    microbatch_sizes,
    signature,
    split_microbatches,
)
from lightning_pipe.pipeline.p2p import PipelineCommunicationError
from lightning_pipe.strategy import logging as pipe_logging
from lightning_pipe.strategy.base import PipeTPParts
from lightning_pipe.strategy.compat import run_hooks, should_accumulate
from lightning_pipe.strategy.outputs import concat_outputs, default_pipeline_input, forward_returns


class PipelineSteps(PipeTPParts):
    """Lightning's step hooks over :meth:`ParallelRuntime.step`."""

    num_microbatches: int | None
    _warned_small_batch: bool

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        batch_idx = epoch_loop.batch_idx
        optimizer = trainer.optimizers[0]
        runtime = self.runtime
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # What the closure would have done (after the step, too late for us): zero the grads.
            run_hooks(trainer, "on_before_zero_grad", optimizer)
            run_hooks(
                trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer, callbacks=False
            )
            runtime.begin_accumulation()
        final = not should_accumulate(trainer)
        runtime.executor.recorder = self._timeline_recorder(trainer.global_step)
        with self.precision_plugin.train_step_context():
            loss = self._run_step("training_step", args, training=True, final=final)
        run_hooks(trainer, "on_after_backward")
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run_step("validation_step", args, training=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run_step("test_step", args, training=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run_step("predict_step", args, training=False)

    def _loss_scaler(self) -> Any:
        """fp16's loss scaling (the precision plugin's gradient scaler), else ``None``."""
        plugin = self.precision_plugin
        scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
        return scaler.scale if scaler is not None else None

    def _microbatches(self, batch: Any) -> int:
        size = batch_size(batch)
        if self.num_microbatches is None:
            return max(1, min(2 * self.mesh.layout.pipeline_parallel_size, size))
        if size < self.num_microbatches:
            # The last batch of an epoch (drop_last=False) may be smaller than num_microbatches:
            # one sample per micro-batch still gives the whole batch's gradient, as on one device.
            if not self._warned_small_batch:
                self._warned_small_batch = True
                rank_zero_warn(
                    f"pipe_tp: a batch of {size} samples is smaller than num_microbatches="
                    f"{self.num_microbatches}; it runs as {size} micro-batches (warned once)."
                )
            return size
        return self.num_microbatches

    def _run_step(self, step_name: str, args: tuple[Any, ...], training: bool, final: bool = False) -> Any:
        """Run one schedule over the batch's micro-batches; return the same result on every rank."""
        module = self.module
        trainer = module.trainer
        batch, rest = args[0], args[1:]
        m = self._microbatches(batch)
        sizes = microbatch_sizes(batch_size(batch), m)
        microbatches = split_microbatches(batch, m)
        to_input = getattr(module, "pipeline_input", default_pipeline_input)
        inputs = [as_layer_arguments(to_input(mb)) for mb in microbatches]
        total = sum(sizes)
        weights = [n / total / trainer.accumulate_grad_batches for n in sizes] if training else None
        capture = pipe_logging.LogCapture() if self.is_last_stage else None

        def head(output: Any, i: int) -> Any:
            if capture is not None:
                capture.microbatch_size = sizes[i]
            with forward_returns(module, output, step_name):
                value = getattr(module, step_name)(microbatches[i], *rest)
            if not training:
                return value
            loss = value.get("loss") if isinstance(value, dict) else value
            if loss is None:
                raise MisconfigurationException(
                    f"training_step returned None for micro-batch {i} of batch "
                    f"{trainer.fit_loop.epoch_loop.batch_idx} (to skip the batch, as on one device). "
                    "Under pipe_tp the other stages have already run "
                    "this micro-batch and wait for its gradient, so a batch cannot be skipped from inside "
                    "training_step. Instead, drop such samples before they reach the model (in the Dataset, "
                    "a collate_fn or the DataLoader's sampler), or return a zero loss (`return loss * 0.0`: "
                    "no gradient, but the optimizer still steps, so momentum and Adam still move weights)."
                )
            if not isinstance(loss, torch.Tensor):
                raise MisconfigurationException(
                    f"training_step must return the loss tensor (or a dict with a 'loss' key) for every "
                    f"micro-batch under pipe_tp, got {type(value).__name__} for micro-batch {i}."
                )
            return loss

        self._check_before_step(step_name, args, batch, inputs[0])
        with (
            pipe_logging.capturing(trainer, capture),
            pipe_logging.batch_level_metrics(module, self.is_last_stage),
            self._naming_first_failure(PipelineCommunicationError),
        ):
            result = self.runtime.step(
                m, inputs, head, training=training, final=final, weights=weights,
                signatures=[signature(x) for x in inputs], scale_loss=self._loss_scaler(),
            )  # fmt: skip

        payload: dict[str, Any] = {}
        if self.is_last_stage:
            outputs = [result.outputs[i] for i in range(m)]
            records = list(capture.records.values()) if capture is not None else []
            payload["records"] = records
            payload["metrics"] = pipe_logging.metric_states(module, records)
            if training:
                payload["loss"] = sum(
                    float(o.detach().double()) * n / total for o, n in zip(outputs, sizes, strict=True)
                )
            elif step_name == "predict_step":
                payload["predictions"] = to_cpu(concat_outputs(outputs))
        payload = self.runtime.from_last_stage(payload)
        pipe_logging.load_metric_states(module, payload["metrics"], self.root_device)
        replicated = self.mesh.layout.data_parallel_size == 1
        pipe_logging.replay(trainer, module, payload["records"], self.reduce, self.root_device, replicated)
        if training:
            return torch.tensor(payload["loss"], dtype=torch.float32, device=self.root_device)
        return payload.get("predictions")
