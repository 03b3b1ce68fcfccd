"""``PipeTPStrategy``: the Lightning adapter over the plain-torch engine.

The strategy keeps Lightning's loops, hooks, launchers and cluster environments (it derives from
``DDPStrategy`` for the process-group plumbing, but never wraps the model in DDP) and replaces
one thing: a training, validation, test or predict *step* runs a whole pipeline schedule over the
micro-batches of the batch. Inside the schedule the user's step runs on the last stage, once per
micro-batch, with ``self(...)`` returning the pipeline output.

Lightning's closure would zero the gradients after ``training_step`` and then call backward; the
executor has already run backward for every micro-batch by then, so the strategy switches the
closure's zero-grad and backward off (the automatic-optimization loop's ``_skip_backward``) and
runs the zero-grad hooks itself at the start of each accumulation window. Optimizer steps,
accumulation, LR schedulers and gradient clipping (by a global norm over all stages) then run
unchanged.
"""

from __future__ import annotations

import os
import signal
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe.checkpoint.full import to_cpu
from lightning_pipe.construction.meta import meta_tensors_set_aside, parameters_on_meta
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.uneven import EvenBatches
from lightning_pipe.failures import FailureBoard
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh, init_mesh
from lightning_pipe.pipeline.executor import CheckpointMode
from lightning_pipe.pipeline.fingerprint import StepIdentity
from lightning_pipe.pipeline.microbatch import batch_size, microbatch_sizes, signature, split_microbatches
from lightning_pipe.pipeline.p2p import PipelineCommunicationError, lost_connection
from lightning_pipe.pipeline.partition import check_partition
from lightning_pipe.pipeline.schedules import ScheduleKind
from lightning_pipe.pipeline.timeline import (
    TimelineRecorder,
    gather_timeline,
    plot_timeline,
    write_chrome_trace,
)
from lightning_pipe.runtime import ConfigurationError, ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.prepare import prepared_record
from lightning_pipe.signals import StopOnSignal, passed_on_by_rank_zero
from lightning_pipe.strategy import logging as pipe_logging
from lightning_pipe.strategy.agreement import StepAgreement
from lightning_pipe.strategy.checkpoints import CheckpointHooks
from lightning_pipe.strategy.compat import use_pipeline_summary
from lightning_pipe.strategy.outputs import concat_outputs, default_pipeline_input, forward_returns
from lightning_pipe.strategy.summary import PipelineModelSummary

DEFAULT_TIMEOUT = timedelta(minutes=5)
_TIMELINE_STEPS = (1, 9)  # skip step 0 (first-step allocations), record the next eight
_SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-true")


class PipeTPStrategy(CheckpointHooks, StepAgreement):
    """Pipeline (GPipe / 1F1B) x tensor x data parallelism for Lightning.

    Args:
        pipeline_parallel_size: number of pipeline stages. ``"auto"``: what the tensor and data
            sizes leave (with both data and pipeline ``"auto"``, every device joins the pipeline).
        tensor_parallel_size: ranks that shard each planned layer (Megatron-style; needs a
            ``tensor_parallel_plan``).
        data_parallel_size: model replicas. ``"auto"``: world size / (pipeline x tensor).
        num_microbatches: micro-batches per batch. ``None``: ``2 x pipeline_parallel_size``,
            capped at the batch size. Batches that do not divide evenly are split like
            ``torch.tensor_split`` and their losses weighted by size.
        schedule: ``"1f1b"`` (default; at most ``pipeline_parallel_size`` micro-batches of
            activations alive per stage) or ``"gpipe"`` (all forwards, then all backwards).
        partition: ``"parameters"`` (default: balance parameter counts), ``"uniform"`` (balance
            layer counts) or a list of layer counts per stage.
        checkpoint: activation recomputation: ``"never"``, ``"except_last"`` or ``"always"``.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default by device.
        timeout: deadline of every collective and point-to-point exchange (default 5 minutes), a
            ``timedelta`` or a number of seconds; ``None``: torch's default (30 minutes):
            past it the waiting rank raises an error naming itself, its stage, the action and
            micro-batch it waited on and its peer, and the job stops instead of hanging.
        check_finite: raise as soon as a stage output or a loss holds NaN/Inf, naming the stage
            and micro-batch where it first appeared.
        bucket_cap_mb: size of the gradient buckets of the data-parallel reducer, whose
            all-reduces overlap the last backward of each optimizer step.
        timeline: record the executed schedule of training steps 1-8 on every rank and write it,
            at the end of ``fit``, to this path: ``.png`` for a plot (needs matplotlib), anything
            else for a Chrome trace (open in Perfetto). Also read from ``LIGHTNING_PIPE_TIMELINE``.
        tensor_parallel_plan: module-name pattern -> style (see
            :mod:`lightning_pipe.tensor_parallel.plan`); overrides the module's
            ``tensor_parallel_plan()`` hook. Needed when ``tensor_parallel_size > 1``.
        save_distributed_checkpoint: ``True`` (default): a checkpoint is a directory in which every
            rank of the first replica writes its own stage's and tensor shard's state, keyed by the
            unsharded module's names, so any layout can load it and
            ``python -m lightning_pipe.consolidate`` turns it into one file. ``False``: rank 0
            gathers the whole model and writes one ordinary Lightning checkpoint file.
        deferred_batch_norm: BatchNorm layers update their running statistics once per batch,
            from the statistics of the whole batch (summed over micro-batches and data-parallel
            replicas), so evaluation uses the statistics one device would have (torchgpipe's
            deferred batch norm). ``False``: they update once per micro-batch.
        pretrained: initial weights for a model built in ``configure_model()`` or under
            ``trainer.init_module(empty_init=True)``, each rank reading only its own stage's
            tensors: a Hugging Face directory (``model.safetensors``, or sharded with
            ``model.safetensors.index.json``), a ``.safetensors`` file, a ``pipe_tp`` sharded
            checkpoint or a Lightning checkpoint file. Weights only: no optimizer or loop state
            (resume with ``ckpt_path``).
        pretrained_prefix: what the module's state-dict keys have before the files' keys (a Hugging
            Face model kept as ``self.llama``: ``"llama."``).
        start_method: ``"popen"`` (Lightning re-launches the script; torchrun and SLURM start
            the processes themselves) or ``"spawn"``/``"fork"``/``"forkserver"``.
    """

    strategy_name = "pipe_tp"

    def __init__(
        self,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        num_microbatches: int | None = None,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        partition: Literal["parameters", "uniform"] | list[int] = "parameters",
        checkpoint: Literal["never", "except_last", "always"] = "never",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        check_finite: bool = False,
        bucket_cap_mb: float = 25.0,
        tensor_parallel_plan: dict[str, str] | None = None,
        timeline: str | None = None,
        save_distributed_checkpoint: bool = True,
        deferred_batch_norm: bool = True,
        pretrained: str | os.PathLike[str] | None = None,
        pretrained_prefix: str = "",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        # No **kwargs: DDPStrategy forwards those to the DDP wrapper, which this strategy never
        # builds, and LightningCLI would list them as options.
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=_check_timeout(timeout),
            start_method=start_method,
        )
        # Validate everything now, before any process is launched or any data is loaded.
        ParallelLayout.resolve(
            _min_world(pipeline_parallel_size, tensor_parallel_size, data_parallel_size),
            pipeline_parallel_size,
            tensor_parallel_size,
            data_parallel_size,
        )
        if num_microbatches is not None and (
            not isinstance(num_microbatches, int)
            or isinstance(num_microbatches, bool)
            or num_microbatches < 1
        ):
            raise ValueError(
                f"num_microbatches must be an integer >= 1 or None (automatic), got {num_microbatches!r}."
            )
        check_partition(partition)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.num_microbatches = num_microbatches
        self.schedule = ScheduleKind.parse(schedule)
        self.partition = partition
        self.checkpoint = CheckpointMode.parse(checkpoint)
        self.check_finite = check_finite
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}.")
        self.bucket_cap_mb = bucket_cap_mb
        self.tensor_parallel_plan = tensor_parallel_plan
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        if pretrained is not None and not os.path.exists(pretrained):
            raise FileNotFoundError(
                f"pretrained={str(pretrained)!r} does not exist: pass a Hugging Face model directory, a "
                ".safetensors file, a pipe_tp checkpoint directory or a Lightning checkpoint file."
            )
        self.pretrained = None if pretrained is None else os.fspath(pretrained)
        self.pretrained_prefix = pretrained_prefix
        self._forward_checked = False
        self.timeline = timeline or os.environ.get("LIGHTNING_PIPE_TIMELINE") or None
        self._recorder: TimelineRecorder | None = None
        self._mesh: ParallelMesh | None = None
        self._runtime: ParallelRuntime | None = None
        self._warned_small_batch = False
        self._signals: StopOnSignal | None = None
        self._failures: FailureBoard | None = None

    # ------------------------------------------------------------------ layout
    @property
    def module(self) -> LightningModule:
        """The LightningModule being trained (it is never wrapped under this strategy)."""
        if self.lightning_module is None:
            raise RuntimeError("The pipe_tp strategy has no LightningModule attached yet.")
        return self.lightning_module

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("The pipe_tp mesh exists only after the processes have started.")
        return self._mesh

    @property
    def runtime(self) -> ParallelRuntime:
        """The plain-torch :class:`~lightning_pipe.runtime.ParallelRuntime` this strategy drives
        (built at setup, once per Trainer call)."""
        if self._runtime is None:
            raise RuntimeError("The pipe_tp runtime exists only after the strategy's setup.")
        return self._runtime

    @property
    def pp_rank(self) -> int:
        return self.mesh.coordinates.pp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.mesh.layout.pipeline_parallel_size - 1

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel replica index: what to shard the data by (with
        :attr:`data_parallel_world_size`). Ranks of one pipeline or tensor group share it."""
        return self.mesh.coordinates.dp_rank

    @property
    def data_parallel_world_size(self) -> int:
        """The number of data-parallel replicas, each loading its own part of the data."""
        return self.mesh.layout.data_parallel_size

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        layout = ParallelLayout.resolve(
            self.world_size, self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        )
        global _SETUP_CALLS
        _SETUP_CALLS += 1  # every rank counts the same Trainer calls: a prefix all ranks agree on
        self._failures = FailureBoard.of_default_group(f"lightning_pipe/failures/{_SETUP_CALLS}")
        self._mesh = None
        with self._collective(f"creating the process groups of the {layout} mesh"):
            self._mesh = init_mesh(layout, "cuda" if self.root_device.type == "cuda" else "cpu")
        if self.world_size > 1 and self._signals is None:
            self._signals = StopOnSignal(
                f"rank {self.global_rank} ({self._mesh.coordinates})",
                before_exit=self._kill_launched_processes,
            )
        if self._signals is not None:
            self._signals.install()

    def _kill_launched_processes(self, signum: int) -> None:
        """Record the signal for the other ranks' errors; the processes Lightning's launcher started
        from this one (ranks 1.. under ``popen``) go at once: each would otherwise print its own
        line and wait to lose a peer."""
        if self._failures is not None:
            self._failures.report(f"received {signal.Signals(signum).name}")
        if self.launcher is not None:
            self.launcher.kill(signal.SIGKILL)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Record this rank's failure, so that the ranks that lose it can name it."""
        if isinstance(exception, SIGTERMException):
            where = f" ({self._mesh.coordinates})" if self._mesh is not None else ""
            passed_on_by_rank_zero(exception, self.global_rank, f"rank {self.global_rank}{where}")
        if self._failures is not None:
            summary = str(exception).strip().splitlines()[0][:300] if str(exception).strip() else ""
            self._failures.report(f"raised {type(exception).__name__}: {summary}")
        super().on_exception(exception)

    def _first_failure_note(self, err: BaseException) -> None:
        """Add to ``err`` which rank failed first, when another rank's failure is recorded."""
        first = self._failures.first() if self._failures is not None else None
        if (
            first is not None
            and not first.startswith(f"rank {self.global_rank} ")
            and hasattr(err, "add_note")
        ):
            err.add_note(f"The first rank to fail: {first}.")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a pipeline must see the same batch: shard data over the data axis only.
        c = self.mesh.coordinates
        return {"num_replicas": self.mesh.layout.data_parallel_size, "rank": c.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every rank stop at the same batch (issue 15, item 9): a data-parallel replica with
        fewer batches would otherwise leave its peers waiting in a step (see
        :mod:`lightning_pipe.data_parallel.uneven`)."""
        if self.world_size == 1 or not isinstance(dataloader, Iterable):
            return dataloader
        stage = self.module.trainer.state.stage
        what = f"{stage.dataloader_prefix if stage is not None else ''} batches".strip()
        others = [r for r in range(self.world_size) if r != self.global_rank]
        return EvenBatches(
            dataloader, self.mesh.layout, cast(dist.ProcessGroup, dist.group.WORLD), self.root_device, what,
            warn=rank_zero_warn, naming=lambda action: self._collective(action, others),
        )  # fmt: skip

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
        """Around ``configure_model()``: parameters are created on the meta device (issue 16)."""
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
        self._build_runtime(module)
        runtime = self.runtime
        use_pipeline_summary(
            trainer, lambda m, depth: PipelineModelSummary(m, runtime.holdings, runtime.plan, depth)
        )
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # The executor runs backward inside training_step; the closure must neither zero the
            # gradients afterwards nor run backward again.
            trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward = True
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_global_clipping()

    def _build_runtime(self, module: LightningModule) -> None:
        """Build this call's runtime: on the module's first setup it splits, shards and
        materialises the model; later calls reuse that (see :mod:`lightning_pipe.runtime.prepare`)."""
        if self._runtime is not None:
            self._runtime.close()
        try:
            self._runtime = self._new_runtime(module)
        except ConfigurationError as err:
            raise MisconfigurationException(str(err)) from err
        # torchmetrics sync over the data axis only: ranks of one pipeline hold the same state.
        for sub in module.modules():
            if isinstance(sub, Metric):
                sub.process_group = self.mesh.group(MeshAxis.DATA)
        for warning in self._runtime.warnings:
            rank_zero_warn(warning)
        self._forward_checked = False
        if self._runtime.first_setup:
            rank_zero_info(self._runtime.describe(self.num_microbatches))

    def _new_runtime(self, module: LightningModule) -> ParallelRuntime:
        layout = self.mesh.layout
        first = prepared_record(module, layout, self.partition) is None
        tp_plan = self.tensor_parallel_plan
        if first and tp_plan is None and layout.tensor_parallel_size > 1:
            hook = getattr(module, "tensor_parallel_plan", None)
            tp_plan = hook() if callable(hook) else None
        options = RuntimeOptions(
            schedule=self.schedule, partition=self.partition, recomputation=self.checkpoint,
            tensor_parallel_plan=tp_plan, bucket_cap_mb=self.bucket_cap_mb, timeout=self._timeout,
            check_finite=self.check_finite, deferred_batch_norm=self.deferred_batch_norm,
        )  # fmt: skip
        # Lightning's global seed when one was set (seed_everything); the runtime uses rank 0's.
        env = os.environ.get("PL_GLOBAL_SEED")
        init = getattr(module, "init_module_weights", None)
        weights = WeightFiles(self.pretrained, self.pretrained_prefix) if first and self.pretrained else None
        return ParallelRuntime(
            module, module.configure_pipeline() if first else [],  # type: ignore[operator]
            self.mesh, self.root_device, options,
            seed=int(env) if env is not None else None, init=init if callable(init) else None,
            weights=weights, naming=self._collective,
        )  # fmt: skip

    @override
    def model_to_device(self) -> None:
        # Only this stage's layers (and the module's own non-layer state) go to the device: the
        # other stages' layers stay where they were built (meta, or off the accelerator).
        assert self.model is not None
        skip = self.runtime.other_stages_tensors()
        device = self.root_device
        self.model._apply(lambda t: t if id(t) in skip else t.to(device))

    @override
    def teardown(self) -> None:
        if self._signals is not None:
            self._signals.uninstall()
        if self._runtime is not None:
            self._runtime.close()
        module = self.lightning_module
        # Other stages' tensors have nothing to move (there may be no module after a failed setup).
        with meta_tensors_set_aside(module) if module is not None else nullcontext():
            super().teardown()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """``configure_optimizers`` as written (``self.parameters()`` lists every stage's); each
        optimizer then keeps only this rank's parameters (issue 16), its groups still described in
        whole-model terms for checkpoints (:mod:`lightning_pipe.checkpoint.optimizer_view`)."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self.runtime.keep_own(optimizer)

    def _check_module(self, module: LightningModule, trainer: Trainer) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"{type(module).__name__} uses manual optimization (automatic_optimization = False), which "
                "the pipe_tp strategy does not support: the pipeline runs forward and backward of all "
                "micro-batches inside one step. Use automatic optimization."
            )
        if not callable(getattr(module, "configure_pipeline", None)):
            raise MisconfigurationException(
                f"{type(module).__name__} has no configure_pipeline() method, which the pipe_tp strategy "
                "needs: return the ordered list of layers to split into stages, e.g. "
                "`def configure_pipeline(self): return list(self.layers)`."
            )
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _SUPPORTED_PRECISION:
            raise MisconfigurationException(
                f"precision={precision!r} is not supported by the pipe_tp strategy yet; use one of "
                f"{list(_SUPPORTED_PRECISION)} (for 16-bit training on GPUs, 'bf16-mixed')."
            )

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper: data-parallel gradients are averaged by the strategy itself."""

    def _install_global_clipping(self) -> None:
        strategy = self

        def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float) -> None:
            strategy.clip_gradients_global_norm(float(clip_val))

        self.precision_plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, self.precision_plugin)  # type: ignore[method-assign]

    def clip_gradients_global_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients, as one device would; returns the norm."""
        return self.runtime.clip_grad_norm_(max_norm)

    # ------------------------------------------------------------------ collectives
    @contextmanager
    def _collective(self, what: str, peers: Sequence[int] = ()) -> Iterator[None]:
        """Name this rank and the operation in any error a collective raises (a peer that failed
        first, or a deadline that passed); ``peers``, the other ranks of the collective's group,
        are named when the error is a lost connection."""
        try:
            yield
        except Exception as err:
            if peers and lost_connection(str(err)) and hasattr(err, "add_note"):
                who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {list(peers)}"
                err.add_note(f"{who} has stopped (its own error, in its log, is the cause).")
            where = f" ({self._mesh.coordinates})" if self._mesh is not None else ""
            note = (
                f"Rank {self.global_rank}{where} failed while {what}; if another rank failed first, its "
                "error is the cause."
            )
            if hasattr(err, "add_note"):
                err.add_note(note)
            self._first_failure_note(err)
            raise

    @override
    def barrier(self, name: str | None = None) -> None:
        with self._collective(f"waiting for every rank at Lightning's barrier {name!r}"):
            super().barrier(name)

    @contextmanager
    def _naming_first_failure(self, kind: type[BaseException]) -> Iterator[None]:
        try:
            yield
        except kind as err:
            self._first_failure_note(err)
            raise

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data axis by default: ranks of one pipeline hold the same logged values."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group or self.mesh.group(MeshAxis.DATA), reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, dist.group.WORLD, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        batch_idx = epoch_loop.batch_idx
        optimizer = trainer.optimizers[0]
        runtime = self.runtime
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # What the closure would have done (after the step, too late for us): zero the grads.
            call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(
                trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer
            )
            runtime.begin_accumulation()
        final = not trainer.fit_loop._should_accumulate()
        runtime.executor.recorder = self._timeline_recorder(trainer.global_step)
        with self.precision_plugin.train_step_context():
            loss = self._run_step("training_step", args, training=True, final=final)
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        return loss

    def _timeline_recorder(self, step: int) -> TimelineRecorder | None:
        """The recorder for training step ``step`` if it is in the recorded window (steps 1-8)."""
        if self.timeline is None or not _TIMELINE_STEPS[0] <= step < _TIMELINE_STEPS[1]:
            return None
        if self._recorder is None:
            self._recorder = TimelineRecorder(self.global_rank)
            self._recorder.start()  # collective: one time origin for all ranks
        return self._recorder

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        recorder = self._runtime.executor.recorder if self._runtime is not None else None
        if recorder is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # The closure (this step's whole pipeline) runs inside optimizer.step: time what follows it.
        closure_end: list[float] = []

        def timed_closure() -> Any:
            result = closure()
            closure_end.append(time.perf_counter())
            return result

        output = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        if closure_end:
            recorder.add_span("optimizer step", closure_end[-1], time.perf_counter())  # type: ignore[attr-defined]
        return output

    @override
    def on_train_end(self) -> None:
        """Write the recorded timeline (a collective: every rank gathers to rank 0)."""
        self._agree(StepIdentity("end of training", -1), None)
        super().on_train_end()
        if self._recorder is None:
            return
        events = gather_timeline(self._recorder)
        self._recorder = None
        if self.global_rank == 0 and self.timeline is not None:
            if self.timeline.endswith(".png"):
                stats = plot_timeline(
                    events, self.timeline, title=f"pipe_tp {self.mesh.layout}, {self.schedule.value}"
                )
                rank_zero_info(
                    f"pipe_tp: timeline plot written to {self.timeline} (bubble {stats.bubble_fraction:.1%})"
                )
            else:
                write_chrome_trace(events, self.timeline)
                rank_zero_info(f"pipe_tp: Chrome trace written to {self.timeline} (open it in Perfetto)")

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
        inputs = [to_input(mb) for mb in microbatches]
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
                signatures=[signature(x) for x in inputs],
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
        payload = self._from_last_stage(payload)
        pipe_logging.load_metric_states(module, payload["metrics"], self.root_device)
        replicated = self.mesh.layout.data_parallel_size == 1
        pipe_logging.replay(trainer, module, payload["records"], self.reduce, self.root_device, replicated)
        if training:
            return torch.tensor(payload["loss"], dtype=torch.float32, device=self.root_device)
        return payload.get("predictions")

    def _from_last_stage(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Send the last stage's ``payload`` to every rank of this pipeline."""
        layout = self.mesh.layout
        if layout.pipeline_parallel_size == 1:
            return payload
        c = self.mesh.coordinates
        src = layout.rank_of(c.dp_rank, layout.pipeline_parallel_size - 1, c.tp_rank)
        box = [payload]
        device = self.root_device if self.root_device.type == "cuda" else None
        with self._collective(
            f"receiving the step's results from the last stage (rank {src})",
            [r for r in self.mesh.pipeline_peers if r != self.global_rank],
        ):
            dist.broadcast_object_list(box, src=src, group=self.mesh.group(MeshAxis.PIPELINE), device=device)
        return box[0]


def _check_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """``timeout`` as a positive ``timedelta`` (numbers are seconds), checked before launch."""
    if timeout is None:
        return None
    given = timeout
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout == timeout:
        timeout = timedelta(seconds=timeout) if timeout > 0 else timedelta(0)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(
            f"timeout must be a positive datetime.timedelta or a positive number of seconds, got "
            f"{given!r}; e.g. PipeTPStrategy(timeout=600) or timeout=timedelta(minutes=10)."
        )
    return timeout


_SETUP_CALLS = 0
"""Trainer calls set up in this process; the same count on every rank of the job."""


def _min_world(pp: int | str, tp: int, dp: int | str) -> int:
    """Smallest world size that fits the given sizes (for validating them before launch)."""
    return (
        (pp if isinstance(pp, int) else 1)
        * (tp if isinstance(tp, int) else 1)
        * (dp if isinstance(dp, int) else 1)
    )
