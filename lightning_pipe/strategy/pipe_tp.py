"""``PipeTPStrategy``: the Lightning adapter over the plain-torch engine.

The strategy keeps Lightning's loops, hooks, launchers and cluster environments (it derives from
``ParallelStrategy``, as Lightning's own model-parallel strategies do, and never wraps the model)
and replaces one thing: a training, validation, test or predict *step* is one call of the
engine's :class:`~lightning_pipe.runtime.ParallelRuntime`, which runs a whole pipeline schedule
over the micro-batches of the batch. Inside it the user's step runs on the last stage, once per
micro-batch, with ``self(...)`` returning the pipeline output (:mod:`.steps`).

Per training step the adapter calls the engine at most three times, plus the optimizer's step:
``begin_accumulation`` at the start of an accumulation window, ``train_batch``, and, when
clipping, ``clip_grad_norm_`` (through the precision plugin). Lightning's closure would zero the
gradients after ``training_step`` and then call backward; the engine has already run backward
for every micro-batch by then, so the strategy switches the closure's zero-grad and backward off
(the automatic-optimization loop's ``_skip_backward``) and runs the zero-grad hooks itself at the
start of each accumulation window. Optimizer steps, accumulation, LR schedulers and gradient
clipping (by a global norm over all stages) then run unchanged.

The class is layered as Lightning layers its own strategies, one concept per module: the
processes, the mesh and Lightning's collectives (:class:`~.processes.PipeTPProcesses`), then the
model's pipeline built at each Trainer call's setup (:class:`~.setup.PipeTPSetup`), then, here,
the constructor, the steps, the loop's hooks and the checkpoint hooks. Its options are documented
and checked once, by the dataclasses of :mod:`.options` (the engine's in
:class:`~lightning_pipe.runtime.RuntimeOptions`); the ``Args:`` of its docstring are assembled
from them. The rest is composed, not inherited: checkpoints (:mod:`.checkpoints`), faults and
signals (:mod:`.faults`), the timeline (:mod:`.recording`), logging (:mod:`.log_capture`),
precision plugins, clipping and fp16's refusals (:mod:`.precision`), the model summary
(:mod:`.summary`), and every touch of Lightning's private state in one place (:mod:`.compat`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

import lightning_pipe.strategy.checkpoints as checkpoints
from lightning_pipe.checkpoint.replace import remove_path
from lightning_pipe.huggingface.adapters import find_peft_model, peft_metadata
from lightning_pipe.huggingface.export import METADATA_KEY as HF_METADATA
from lightning_pipe.huggingface.export import model_metadata
from lightning_pipe.planning.auto import record
from lightning_pipe.strategy.auto_layout import AUTO_LAYOUT_KEY, auto_constraints, batch_differs
from lightning_pipe.strategy.compat import run_hooks, should_accumulate, weights_only_of_running_call
from lightning_pipe.strategy.option_types import PositiveFloat, PositiveInt
from lightning_pipe.strategy.options import DEFAULT_TIMEOUT, constructor_docstring, split_arguments
from lightning_pipe.strategy.pipeline_model import Redirect
from lightning_pipe.strategy.precision import loss_scaler
from lightning_pipe.strategy.setup import PipeTPSetup
from lightning_pipe.strategy.step_inputs import learn_step_inputs
from lightning_pipe.strategy.steps import run_step


class PipeTPStrategy(PipeTPSetup):
    """Pipeline x tensor x data parallelism for Lightning (see the module docstring).

    Its ``Args:`` are added at import from each option's one description (:mod:`.options`)."""

    strategy_name = "pipe_tp"

    def __init__(
        self,
        pipeline_parallel_size: PositiveInt | Literal["auto"] = "auto",
        tensor_parallel_size: PositiveInt = 1,
        data_parallel_size: PositiveInt | Literal["auto"] = "auto",
        num_microbatches: PositiveInt | None = None,
        schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"] = "1f1b",
        virtual_stages: PositiveInt | None = None,
        partition: Literal["parameters", "uniform", "time"] | list[int] = "parameters",
        recompute: Literal["never", "except_last", "always"] = "never",
        layout: Literal["auto"] | None = None,
        max_memory: int | float | str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | PositiveFloat | None = DEFAULT_TIMEOUT,
        check_finite: bool = False,
        check_forward: bool = True,
        compile: bool | dict[str, Any] = False,
        bucket_cap_mb: PositiveFloat = 25.0,
        shard_optimizer_state: bool = False,
        overlap_param_gather: bool = True,
        sequence_parallel: bool = False,
        layer_seeded_dropout: bool | None = None,
        shard_parameters: bool = False,
        data_parallel_replicate_size: PositiveInt = 1,
        expert_parallel_size: PositiveInt = 1,
        expert_parallel_plan: dict[str, str] | None = None,
        context_parallel_size: PositiveInt = 1,
        reshard_after_forward: bool | None = None,
        tensor_parallel_plan: dict[str, str] | None = None,
        timeline: str | None = None,
        timeline_steps: PositiveInt = 1,
        save_distributed_checkpoint: bool = True,
        deferred_batch_norm: bool = True,
        allow_batch_norm_microbatches: bool = False,
        pretrained: str | os.PathLike[str] | None = None,
        pretrained_prefix: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        # Every option is checked first, by the dataclass that documents it (strategy/options.py),
        # each with one sentence naming it, its value and what is allowed, before anything else runs
        # (LightningCLI shows that sentence as the error).
        arguments = locals()
        own, options = split_arguments(arguments)
        # Under layout="auto": the options the user set, which the planner keeps.
        constraints = auto_constraints(arguments, PipeTPStrategy.__init__) if own.layout == "auto" else None
        super().__init__(
            own,
            options,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            auto_constraints=constraints,
        )
        self.save_distributed_checkpoint = own.save_distributed_checkpoint
        self._auto_batch_checked = False

    # ------------------------------------------------------------------ steps
    @property
    def _redirect(self) -> Redirect:
        if self.pipeline_model is None:
            raise RuntimeError("The pipe_tp strategy runs steps only after its setup.")
        return self.pipeline_model.redirect

    def _prepare_step(self, step_name: str, args: tuple[Any, ...]) -> None:
        """A derived Hugging Face pipeline learns which batch tensors the step gives the model
        (on each step kind's first batch; see :mod:`lightning_pipe.strategy.step_inputs`)."""
        view = self.pipeline_model
        if view is None or view.step_inputs is None:
            return
        if self.options.context_parallel_size > 1:
            # A batch cut for context parallelism is a collator's dict, taken by its keys (the cut
            # refuses others): roles learned on the whole batch would name its 'labels', which the
            # cut turns into 'shift_labels'.
            return
        learn_step_inputs(
            self.module, step_name, args, view.huggingface.model, view.step_inputs, self._gather_objects
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.module.trainer
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        if self.auto_plan is not None and not self._auto_batch_checked and args:
            self._auto_batch_checked = True  # once: the first batch says what the dataloader gives
            warning = batch_differs(self.auto_plan, args[0])
            if warning is not None:
                rank_zero_warn(warning)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # What the closure would have done (after the step, too late for us): zero the grads.
            optimizer = trainer.optimizers[0]
            run_hooks(trainer, "on_before_zero_grad", optimizer)
            run_hooks(
                trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer, callbacks=False
            )
            self.runtime.begin_accumulation()
        with self.precision_plugin.train_step_context():
            loss = run_step(
                self.module, self.runtime, "training_step", args, self.reduce, self._redirect,
                final=not should_accumulate(trainer), loss_weight=1.0 / trainer.accumulate_grad_batches,
                scale_loss=loss_scaler(self.precision_plugin),
                recorder=self.timeline.recorder_for(trainer.global_step, self.global_rank, self.root_device),
                prepare=self._prepare_step,
            )  # fmt: skip
        run_hooks(trainer, "on_after_backward")
        return loss

    def _eval_step(self, step_name: str, args: tuple[Any, ...]) -> Any:
        redirect, prepare = self._redirect, self._prepare_step
        return run_step(self.module, self.runtime, step_name, args, self.reduce, redirect, prepare=prepare)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", args)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # This step's recorder (the closure's training_step asks for the same one).
        recorder = self.timeline.recorder_for(
            self.module.trainer.global_step, self.global_rank, self.root_device
        )
        if recorder is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The closure (this step's whole pipeline) runs inside optimizer.step: time what follows it.
        closure_end: list[Any] = []

        def timed_closure() -> Any:
            result = closure()
            closure_end.append(recorder.stamp())
            return result

        output = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        if closure_end:
            recorder.add_span("optimizer step", closure_end[-1], recorder.stamp())
        return output

    # ZeRO-1's parameter gathers overlap the next training forward; where the loop leaves
    # training, every parameter is made whole first (the callbacks' hooks of the same name ran
    # before, their reads guarded: see lightning_pipe/data_parallel/parameter_gather.py).
    @override
    def on_validation_start(self) -> None:
        self.runtime.wait_for_parameters()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.runtime.wait_for_parameters()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.runtime.wait_for_parameters()
        super().on_predict_start()

    # A rank whose dataloader ran out first reaches the end of the loop while its peers still run
    # a step: agreeing on "the end" makes both sides stop with the same message.
    @override
    def on_validation_end(self) -> None:
        self.runtime.agree_end("end of validation")
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self.runtime.agree_end("end of test")
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self.runtime.agree_end("end of predict")
        super().on_predict_end()

    @override
    def on_train_end(self) -> None:
        self.runtime.wait_for_parameters()  # the last step's gathers: no forward waits for them
        self.runtime.agree_end("end of training")
        super().on_train_end()
        self.timeline.write(
            self.mesh, self.runtime.partition, self.schedule.value, self.root_device, self.num_processes
        )

    # ------------------------------------------------------------------ faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Record this rank's failure, so that the ranks that lose it can name it."""
        self.faults.on_exception(exception, self.global_rank)
        if self._runtime is not None:  # a peer may be gone: waiting could last the whole timeout
            self._runtime.abandon_pending_work()
        super().on_exception(exception)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after the model is split and sliced: each rank then reads only its stage's keys and
        # cuts its own tensor-parallel slices, whatever layout saved the checkpoint.
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model (a checkpoint directory), or the whole model on rank 0."""
        # The first call of a save (dump_checkpoint asks for the model first): every rank must be
        # here, or the save's collectives would wait on ranks that are elsewhere.
        checkpoints.every_rank_saves(self.faults.naming, self.global_rank, self._timeout)
        self.runtime.wait_for_parameters()
        return checkpoints.model_state(self.runtime, self.save_distributed_checkpoint, self.faults.naming)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # Under ZeRO-1 the state is read through LogicalOptimizer.state_dict(), which waits for
        # the parameters' gathers itself.
        return checkpoints.optimizer_state(
            self.runtime, optimizer, self.save_distributed_checkpoint, self.faults.naming
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "PipeTPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy "
                "writes checkpoints itself rather than through a CheckpointIO plugin."
            )
        path = Path(self.broadcast(str(filepath)))
        derived = self.pipeline_model.huggingface if self.pipeline_model is not None else None
        if derived is not None:  # what python -m lightning_pipe.consolidate --to-huggingface reads
            root = self.lightning_module
            wrapper = find_peft_model(root, derived.name) if root is not None else None
            peft = peft_metadata(*wrapper) if wrapper is not None else None
            checkpoint[HF_METADATA] = model_metadata(derived.model, derived.prefix, peft)
        if self.auto_plan is not None:  # what layout="auto" chose, and the prediction it rests on
            checkpoint[AUTO_LAYOUT_KEY] = record(self.auto_plan)
        checkpoints.save(self.runtime, checkpoint, path, self.save_distributed_checkpoint, self.faults.naming)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))  # a checkpoint directory, a file, or a save_last="link" symlink

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is None:
            # Lightning drops the caller's weights_only for strategies that restore after setup.
            weights_only = weights_only_of_running_call()
        path = Path(self.broadcast(str(checkpoint_path)))
        return checkpoints.load(
            self.runtime, path, self.optimizers, self.module.strict_loading, weights_only,
            super().load_checkpoint, self.faults.naming,
        )  # fmt: skip

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        checkpoints.load_model(self.runtime, checkpoint, strict, self.faults.naming)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        checkpoints.load_optimizers(self.runtime, checkpoint, self.optimizers, self.faults.naming)


# LightningCLI (jsonargparse) reads the Args of __doc__ for --help: assembled from the options'
# own descriptions, so that each is written once.
PipeTPStrategy.__doc__ = constructor_docstring(PipeTPStrategy.__doc__ or "", PipeTPStrategy.__init__)
