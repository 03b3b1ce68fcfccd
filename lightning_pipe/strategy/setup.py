"""Building the model's pipeline for one Trainer call: the second layer of ``PipeTPStrategy``.

On the processes and mesh of :mod:`.processes`, Lightning's setup becomes: check the module
(automatic optimization, layers to split, a supported precision), read it
(:mod:`.pipeline_model`: its layers, plan and hooks, or a Hugging Face model's), build the
engine's :class:`~lightning_pipe.runtime.ParallelRuntime` (on the module's first setup it splits,
slices and materialises the model; later calls reuse that), move only this rank's stage to its
device, keep each optimizer to this rank's parameters, and install the global-norm clipping and
fp16's agreed scaler (:mod:`.precision`). Teardown closes the runtime. Also the construction
contexts (``trainer.init_module()``, ``configure_model()``: parameters on the meta device).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe.construction.meta import meta_tensors_set_aside, parameters_on_meta
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.mesh import MeshAxis
from lightning_pipe.planning import Constraints, NothingFitsError
from lightning_pipe.planning.auto import describe
from lightning_pipe.runtime import (
    ConfigurationError,
    ParallelRuntime,
    RecomputeMode,
    RuntimeOptions,
    ShardingError,
    preparation_of,
)
from lightning_pipe.schedule.builders import ScheduleKind
from lightning_pipe.strategy.auto_layout import log_choice, memory_limit, plan_module
from lightning_pipe.strategy.compat import optimizers_to_device, skip_closure_backward, use_pipeline_summary
from lightning_pipe.strategy.options import StrategyOptions
from lightning_pipe.strategy.pipeline_model import (
    PipelineModel,
    expert_parallel_plan,
    find_causal_lm,
    read_module,
)
from lightning_pipe.strategy.precision import (
    PipeTPPrecision,
    check_precision,
    install_global_clipping,
    with_global_clipping,
)
from lightning_pipe.strategy.processes import PipeTPProcesses
from lightning_pipe.strategy.recording import TimelineRecording
from lightning_pipe.strategy.summary import PipelineModelSummary


class PipeTPSetup(PipeTPProcesses):
    """The model's pipeline on this rank, built at each Trainer call's setup (see the module
    docstring)."""

    def __init__(
        self,
        own: StrategyOptions,
        options: RuntimeOptions,
        auto_constraints: Constraints | None = None,
        **plugins: Any,
    ) -> None:
        super().__init__(own, options, auto_constraints, **plugins)  # plugins: see PipeTPProcesses
        self.tensor_parallel_plan = own.tensor_parallel_plan
        self.pretrained = cast(str | None, own.pretrained)
        self.pretrained_prefix = own.pretrained_prefix
        self.timeline = TimelineRecording(
            own.timeline or os.environ.get("LIGHTNING_PIPE_TIMELINE") or None, own.timeline_steps
        )
        self._runtime: ParallelRuntime | None = None
        self.pipeline_model: PipelineModel | None = None
        """What the strategy read from the LightningModule at this call's setup."""

    # ------------------------------------------------------------------ the engine options, read
    @property
    def num_microbatches(self) -> int | None:
        return self.options.num_microbatches

    @property
    def schedule(self) -> ScheduleKind:
        return self.options.schedule_kind

    @property
    def virtual_stages(self) -> int:
        return self.options.virtual_stages

    @property
    def partition(self) -> Any:
        return self.options.partition

    @property
    def recompute(self) -> RecomputeMode:
        return self.options.recompute_mode

    # ------------------------------------------------------------------ the runtime
    @property
    def runtime(self) -> ParallelRuntime:
        """The plain-torch :class:`~lightning_pipe.runtime.ParallelRuntime` this strategy drives
        (built at setup, once per Trainer call)."""
        if self._runtime is None:
            raise RuntimeError("The pipe_tp runtime exists only after the strategy's setup.")
        return self._runtime

    @property
    def holds_first_stage(self) -> bool:
        if self._runtime is None:  # before setup: stage 0 is on pipeline rank 0 in every placement
            return self.pp_rank == 0
        return self._runtime.holds_first_stage

    @property
    def holds_last_stage(self) -> bool:
        if self._runtime is None:  # the last stage is on the last pipeline rank in every placement
            return self.pp_rank == self.mesh.layout.pipeline_parallel_size - 1
        return self._runtime.holds_last_stage

    # ------------------------------------------------------------------ construction
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module()``: the model is built on the CPU (each rank moves only its own
        stage to its device at setup); with ``empty_init=True`` its parameters are created on the
        meta device and each rank materialises only its own stage and tensor slice at setup."""
        meta = (
            parameters_on_meta("trainer.init_module(empty_init=True) under pipe_tp")
            if empty_init
            else nullcontext()
        )
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        """Around ``configure_model()``: parameters are created on the meta device."""
        with parameters_on_meta("configure_model() under pipe_tp"):
            yield

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer) -> None:
        module = self.module
        self._check_module(module, trainer)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(module)
        if self.layout_pending:
            self._choose_layout(module, trainer)
        self._build_runtime(module, trains=trainer.state.fn == TrainerFn.FITTING)
        runtime = self.runtime
        use_pipeline_summary(
            trainer,
            lambda m, depth: PipelineModelSummary(
                m, runtime.holdings, runtime.partition, depth, self.mesh.layout.pipeline_parallel_size
            ),
        )
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # The engine runs backward inside training_step; the closure must neither zero the
            # gradients afterwards nor run backward again.
            skip_closure_backward(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        self._install_global_clipping(trainer)

    def _choose_layout(self, module: LightningModule, trainer: Trainer) -> None:
        """``layout="auto"``: measure, agree on a plan, print it, refuse when nothing fits (on every
        rank, before the model is materialised), then take the chosen sizes and options, record them
        in the loggers' hyperparameters and build their mesh."""
        assert self.auto_constraints is not None
        memory = memory_limit(self.max_memory, self.root_device)
        with self.faults.naming("choosing the layout (layout='auto': global rank 0 measures, then sends)"):
            plan = plan_module(
                module, self.tensor_parallel_plan, self.pretrained_prefix, self.root_device, memory,
                self.auto_constraints,
            )  # fmt: skip
        rank_zero_info(describe(plan))
        try:
            best = plan.chosen()
        except NothingFitsError as err:
            raise MisconfigurationException(f"pipe_tp layout='auto': {err}") from None
        chosen = best.candidate.options()
        self.pipeline_parallel_size = best.candidate.pipeline_parallel_size
        self.tensor_parallel_size = best.candidate.tensor_parallel_size
        self.data_parallel_size = best.candidate.data_parallel_size
        engine: dict[str, Any] = {
            k: v for k, v in chosen.items() if k in {f.name for f in dataclasses.fields(RuntimeOptions)}
        }
        if self.options.partition != RuntimeOptions.partition:
            del engine["partition"]  # a method the user chose is kept (the default gives way to "time")
        self.options = dataclasses.replace(self.options, **engine)
        self.auto_plan = plan
        log_choice(trainer.loggers, plan)  # the choice in the run's logs, with the rest
        self.start_mesh()

    def _build_runtime(self, module: LightningModule, trains: bool = True) -> None:
        """Build this call's runtime: on the module's first setup it splits, slices and
        materialises the model; later calls reuse that (see :mod:`lightning_pipe.runtime.prepare`)."""
        if self._runtime is not None:
            self._runtime.close()
        try:
            self._runtime = self._new_runtime(module, trains)
        except ConfigurationError as err:
            raise MisconfigurationException(str(err)) from err
        # torchmetrics sync over the data axis only: ranks of one pipeline hold the same state.
        for sub in module.modules():
            if isinstance(sub, Metric):
                sub.process_group = self.mesh.group(MeshAxis.DATA)
        if self._runtime.first_setup:
            rank_zero_info(self._runtime.describe())

    def _new_runtime(self, module: LightningModule, trains: bool) -> ParallelRuntime:
        layout = self.mesh.layout
        first = preparation_of(module, layout, self.partition, self.virtual_stages) is None
        view = read_module(
            module,
            first,
            layout.tensor_parallel_size,
            self.tensor_parallel_plan,
            self.pretrained_prefix,
            sequence_parallel=self.options.sequence_parallel,
        )
        self.pipeline_model = view
        if first:
            for note in view.notes:
                rank_zero_info(f"pipe_tp: {note}")
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        bf16 = self.options.shard_parameters and precision == "bf16-mixed"
        options = dataclasses.replace(
            self.options,
            tensor_parallel_plan=view.tensor_parallel_plan,
            expert_parallel_plan=expert_parallel_plan(
                view, layout.expert_parallel_size, self.options.expert_parallel_plan
            )
            if first
            else self.options.expert_parallel_plan,
            timeout=self._timeout,
            # bf16-mixed under shard_parameters: parameters gathered (and computed) in bfloat16.
            param_dtype=torch.bfloat16 if bf16 else None,
        )
        # Lightning's global seed when one was set (seed_everything); the runtime uses rank 0's.
        env = os.environ.get("PL_GLOBAL_SEED")
        weights = WeightFiles(self.pretrained, view.pretrained_prefix) if first and self.pretrained else None
        # partition="time": the runtime times the layers on a micro-batch of forward's example input.
        example = getattr(module, "example_input_array", None)
        return ParallelRuntime(
            module, view.layers, self.mesh, self.root_device, options,
            seed=int(env) if env is not None else None, init=view.init,
            weights=weights, example_input=example, board=self.faults.board, hooks=view.hooks, trains=trains,
        )  # fmt: skip

    @override
    def model_to_device(self) -> None:
        # Only this stage's layers (and the module's own non-layer state) go to the device: the
        # other stages' layers stay where they were built (meta, or off the accelerator).
        assert self.model is not None
        skip = self.runtime.other_stages_tensors()
        device = self.root_device
        # Shards (shard_parameters) are where FSDP put them, the device, unless Lightning's teardown of
        # an earlier Trainer call moved the model to the host (FSDP re-pads what it moves back).
        self.model._apply(
            lambda t: t if id(t) in skip or (isinstance(t, DTensor) and t.device == device) else t.to(device)
        )
        self.runtime.after_model_moved()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """``configure_optimizers`` as written (``self.parameters()`` lists every stage's); each
        optimizer then keeps only this rank's parameters, its groups still described in
        whole-model terms for checkpoints (:mod:`lightning_pipe.checkpoint.optimizer_view`)."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            try:
                self.runtime.keep_own(optimizer)
            except ShardingError as err:
                raise MisconfigurationException(str(err)) from err

    def _check_module(self, module: LightningModule, trainer: Trainer) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(module).__name__} uses manual optimization (automatic_optimization = False), which "
                "the pipe_tp strategy does not support: the pipeline runs forward and backward of all "
                "micro-batches inside one step. Use automatic optimization."
            )
        if not callable(getattr(module, "configure_pipeline", None)) and find_causal_lm(module) is None:
            raise MisconfigurationException(
                f"{type(module).__name__} has no configure_pipeline() method and holds no Hugging Face "
                "causal LM, so the pipe_tp strategy cannot tell its layers: return the ordered list of "
                "layers to split into stages, e.g. `def configure_pipeline(self): return list(self.layers)`."
            )
        check_precision(self.precision_plugin)

    @override
    def teardown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        module = self.lightning_module
        if (
            module is not None
            and module._trainer is not None
            and module.trainer.state.fn == TrainerFn.FITTING
        ):
            self.timeline.not_written()
        self.faults.teardown()
        # Other stages' tensors have nothing to move (there may be no module after a failed setup).
        with meta_tensors_set_aside(module) if module is not None else nullcontext():
            super().teardown()
        if self._runtime is not None:
            # Lightning's teardown moved the model to the host, which makes FSDP2's parameters new
            # objects, without the attributes a checkpoint reads (a tensor-parallel slice's dim, the
            # experts a parameter holds): a `trainer.save_checkpoint` after fit wrote tp_dim null
            # and half the vocabulary under tensor_parallel_size=2 with shard_parameters.
            self._runtime.after_model_moved()

    # ------------------------------------------------------------------ precision and clipping
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else PipeTPPrecision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning builds the plugin from Trainer(precision=...) and hands it to the strategy:
        # its pipe_tp subclass clips by the whole model's norm (see strategy/precision.py).
        self._precision_plugin = with_global_clipping(precision_plugin)

    def _install_global_clipping(self, trainer: Trainer) -> None:
        install_global_clipping(
            trainer, self.precision_plugin, self.optimizers, self.runtime, self.mesh.model_group,
            self.root_device, self._clip_by_global_norm,
        )  # fmt: skip

    def _clip_by_global_norm(self, max_norm: float) -> torch.Tensor:
        # Looked up per call: the plugin keeps no reference to one Trainer call's runtime.
        return self.runtime.clip_grad_norm_(max_norm)
