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

The rest is composed, not inherited: checkpoints (:mod:`.checkpoints`), faults and signals
(:mod:`.faults`), the timeline (:mod:`.recording`), logging (:mod:`.log_capture`), precision
plugins (:mod:`.precision`), the model summary (:mod:`.summary`), and every touch of Lightning's
private state in one place (:mod:`.compat`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor
from torchmetrics import Metric
from typing_extensions import override

import lightning_pipe.strategy.checkpoints as checkpoints
from lightning_pipe.arguments import check_count, check_flag
from lightning_pipe.batches.uneven import EvenBatches
from lightning_pipe.checkpoint.replace import remove_path
from lightning_pipe.construction.meta import meta_tensors_set_aside, parameters_on_meta
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.sharded_optimizer import ShardingError
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.huggingface.adapters import find_peft_model, peft_metadata
from lightning_pipe.huggingface.export import METADATA_KEY as HF_METADATA
from lightning_pipe.huggingface.export import model_metadata
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh, check_replicate_size, init_mesh
from lightning_pipe.runtime import ConfigurationError, GradientSharding, ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.grad_scaler import AgreedGradScaler
from lightning_pipe.runtime.prepare import preparation_of
from lightning_pipe.schedule.builders import ScheduleKind
from lightning_pipe.strategy.compat import (
    default_backend,
    init_process_group,
    launcher,
    optimizers_to_device,
    run_hooks,
    set_rank_zero,
    should_accumulate,
    skip_closure_backward,
    sync_ddp,
    use_pipeline_summary,
    weights_only_of_running_call,
)
from lightning_pipe.strategy.faults import FaultHandling
from lightning_pipe.strategy.option_types import PositiveFloat, PositiveInt
from lightning_pipe.strategy.pipeline_model import PipelineModel, Redirect, find_causal_lm, read_module
from lightning_pipe.strategy.precision import GlobalNormClipping, PipeTPPrecision, with_global_clipping
from lightning_pipe.strategy.recording import TimelineRecording
from lightning_pipe.strategy.step_inputs import learn_step_inputs
from lightning_pipe.strategy.steps import run_step
from lightning_pipe.strategy.summary import PipelineModelSummary

DEFAULT_TIMEOUT = timedelta(minutes=5)
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


class PipeTPStrategy(ParallelStrategy):
    """Pipeline x tensor x data parallelism for Lightning (see the module docstring).

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
            activations alive per stage), ``"gpipe"`` (all forwards, then all backwards) or
            ``"interleaved_1f1b"`` (``virtual_stages`` stages per rank in loop placement; a
            bubble ``virtual_stages`` times smaller, more activations held: Megatron's virtual
            pipeline) or ``"zb_h1"`` (zero-bubble: backward split into the input gradient, sent
            at once, and the weight gradient, run later in what would be idle time; a third of
            1F1B's bubble, every stage holding up to ``pipeline_parallel_size`` micro-batches).
        virtual_stages: stages per pipeline rank for ``"interleaved_1f1b"`` (default 2); the
            model is split into ``pipeline_parallel_size x virtual_stages`` stages.
        partition: ``"parameters"`` (default: balance parameter counts), ``"uniform"`` (balance
            layer counts), ``"time"`` (balance forward + backward time, measured at setup on one
            micro-batch of ``example_input_array``, layer by layer; the layout log shows each
            stage's time) or a list of layer counts per stage.
        recompute: activation recomputation: ``"never"``, ``"except_last"`` or ``"always"``.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default by device.
        timeout: deadline of every collective and point-to-point exchange (default 5 minutes), a
            ``timedelta`` or a number of seconds; ``None``: torch's default (30 minutes):
            past it the waiting rank raises an error naming itself, its stage, the action and
            micro-batch it waited on and its peer, and the job stops instead of hanging.
        check_finite: raise as soon as a stage output or a loss holds NaN/Inf, naming the stage
            and micro-batch where it first appeared.
        check_forward: on the first step after setup, check that the module's ``forward`` is its
            pipeline layers chained (logic around them would be skipped in training). ``False``
            skips the check (and its warning when a meta-built model cannot be compared).
        bucket_cap_mb: size of the gradient buckets of the data-parallel reducer, whose
            all-reduces overlap the last backward of each optimizer step.
        shard_optimizer_state: ZeRO-1 (Megatron's distributed optimizer): each data-parallel
            replica keeps the optimizer state of 1/data_parallel_size of its stage; gradients are
            reduce-scattered (still overlapping the last backward), each replica steps its slice
            and the parameters are all-gathered after ``optimizer.step()``. Element-wise
            optimizers only (SGD, Adam, AdamW, ...); after the backward, parameters' ``.grad`` are
            ``None`` (the averaged gradient exists only as slices). Checkpoints stay unsharded by
            parameter name.
        overlap_param_gather: with ``shard_optimizer_state``, the parameters' all-gather is
            launched after the step and each layer's next forward waits for its own buckets
            (Megatron's ``overlap_param_gather``); weights read in between (a callback, a
            checkpoint, validation, after ``fit``) wait for all of it first. Not guarded: reads
            from another Python thread (torch's function-mode stack is per thread) and through an
            alias made before the step (``self.ref = p.detach()``): call
            ``strategy.runtime.wait_for_parameters()`` first (safe from any thread).
            ``False``: the step waits for the gather.
        sequence_parallel: with ``tensor_parallel_size > 1``, keep the activations between the
            tensor-parallel regions (norms, dropout, the residual stream, what stages exchange)
            split along the sequence over the tensor ranks (Megatron's sequence parallelism); the
            plan says where the split begins (``sequence_scatter``) and which modules see the
            whole sequence (``sequence_gather``). Turns on ``layer_seeded_dropout``.
        layer_seeded_dropout: each layer draws its dropout masks from a seed of (the run's seed,
            the training batch, the micro-batch, the layer's index), so any pipeline and tensor
            split draws the same masks: a run equals this model under pipe_tp on one process with
            the same ``num_microbatches`` (not across data-parallel sizes: replicas draw equal
            masks; ``"dropout"`` plan entries keep their per-tensor-rank streams). ``None``: on
            with ``sequence_parallel``, else off (each rank draws from its own generator).
        shard_parameters: FSDP2 over the data axis: each data-parallel rank keeps 1/dp of its
            stage's parameters, gradients and optimizer state.
        data_parallel_replicate_size: HSDP under ``shard_parameters``: the data axis as this many
            replicas of ``data_parallel_size / this`` shards each.
        reshard_after_forward: under ``shard_parameters``, ``False`` gathers a stage once per step
            and reduces once per accumulation window, ``True`` frees after each forward and
            reduces every backward; ``None``: ``True`` without a pipeline, else ``False``.
        timeline: record the executed schedule of training steps (from step 1: step 0 pays for
            first-time allocations) on every rank and write it, at the end of ``fit``, to this path:
            ``.png`` for a plot (needs matplotlib), anything else for a Chrome trace (open in
            Perfetto). Also read from ``LIGHTNING_PIPE_TIMELINE``.
        timeline_steps: how many training steps the timeline records (default 1: one readable step).
        tensor_parallel_plan: module-name pattern -> style (see
            :mod:`lightning_pipe.tensor_parallel.plan`); overrides the module's
            ``tensor_parallel_plan()`` hook. Needed when ``tensor_parallel_size > 1``.
        save_distributed_checkpoint: ``True`` (default): a checkpoint is a directory in which every
            rank of the first replica writes its own stage's and tensor slice's state, keyed by the
            unsliced module's names, so any layout can load it and
            ``python -m lightning_pipe.consolidate`` turns it into one file. ``False``: rank 0
            gathers the whole model and writes one ordinary Lightning checkpoint file.
        deferred_batch_norm: BatchNorm layers update their running statistics once per batch,
            from the statistics of the whole batch (summed over micro-batches and data-parallel
            replicas), so evaluation uses the statistics one device would have (torchgpipe's
            deferred batch norm). ``False``: they update once per micro-batch.
        allow_batch_norm_microbatches: train a model holding BatchNorm layers with several
            micro-batches per batch, each normalised in training by its own statistics (not the
            batch's, as on one device: a different model, said once as a warning). ``False``
            (default): ``fit`` refuses such a model at setup, naming the fixes
            (``num_microbatches=1``, GroupNorm/LayerNorm, or this option).
        pretrained: initial weights for a model built in ``configure_model()`` or under
            ``trainer.init_module(empty_init=True)``, each rank reading only its own stage's
            tensors: a Hugging Face directory (``model.safetensors``, or sharded with
            ``model.safetensors.index.json``), a ``.safetensors`` file, a ``pipe_tp``
            checkpoint directory or a Lightning checkpoint file. Weights only: no optimizer or loop state
            (resume with ``ckpt_path``).
        pretrained_prefix: what the module's state-dict keys have before the files' keys (a Hugging
            Face model kept as ``self.llama``: ``"llama."``). ``None`` (default): the derived Hugging
            Face model's own name (``"model."`` for ``self.model``), else nothing.
        start_method: ``"popen"`` (Lightning re-launches the script; torchrun and SLURM start
            the processes themselves) or ``"spawn"``/``"fork"``/``"forkserver"``.
    """

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
        process_group_backend: str | None = None,
        timeout: timedelta | PositiveFloat | None = DEFAULT_TIMEOUT,
        check_finite: bool = False,
        check_forward: bool = True,
        bucket_cap_mb: PositiveFloat = 25.0,
        shard_optimizer_state: bool = False,
        overlap_param_gather: bool = True,
        sequence_parallel: bool = False,
        layer_seeded_dropout: bool | None = None,
        shard_parameters: bool = False,
        data_parallel_replicate_size: PositiveInt = 1,
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
        # Every option is checked first, each with one sentence naming it, its value and what is
        # allowed, before anything else runs (LightningCLI shows that sentence as the error).
        _check_sizes(pipeline_parallel_size, tensor_parallel_size, data_parallel_size)
        if virtual_stages is not None:
            check_count("virtual_stages", virtual_stages, also="None")
        check_count("timeline_steps", timeline_steps)
        for name, flag in (
            ("check_finite", check_finite),
            ("check_forward", check_forward),
            ("shard_optimizer_state", shard_optimizer_state),
            ("overlap_param_gather", overlap_param_gather),
            ("save_distributed_checkpoint", save_distributed_checkpoint),
            ("deferred_batch_norm", deferred_batch_norm),
            ("allow_batch_norm_microbatches", allow_batch_norm_microbatches),
        ):
            check_flag(name, flag)
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {list(_START_METHODS)}, got {start_method!r}.")
        if tensor_parallel_plan is not None and not (
            isinstance(tensor_parallel_plan, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in tensor_parallel_plan.items())
        ):
            raise ValueError(
                "tensor_parallel_plan must map module-name patterns to style names (a dict of strings), got "
                f"{tensor_parallel_plan!r}."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._timeout = _check_timeout(timeout)
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self._num_nodes = 1
        # The requested sizes ("auto" resolved when the processes exist); every engine option
        # lives once, in the runtime's options (the tensor-parallel plan and the deadline are
        # filled in at setup).
        self.pipeline_parallel_size = pipeline_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        interleaved = ScheduleKind.parse(schedule) is ScheduleKind.INTERLEAVED_1F1B
        self.options = RuntimeOptions(
            num_microbatches=num_microbatches,
            schedule=schedule,
            partition=partition,
            recompute=recompute,
            virtual_stages=virtual_stages if virtual_stages is not None else (2 if interleaved else 1),
            bucket_cap_mb=bucket_cap_mb,
            shard_optimizer_state=shard_optimizer_state,
            overlap_param_gather=overlap_param_gather,
            sequence_parallel=sequence_parallel,
            layer_seeded_dropout=layer_seeded_dropout,
            shard_parameters=shard_parameters,
            data_parallel_replicate_size=data_parallel_replicate_size,
            reshard_after_forward=reshard_after_forward,
            check_finite=check_finite,
            deferred_batch_norm=deferred_batch_norm,
            allow_batch_norm_microbatches=allow_batch_norm_microbatches,
            check_forward=check_forward,
        )
        """The engine's options, checked before any process is launched."""
        if data_parallel_size != "auto":  # else once the world size is known (_configure_launcher)
            check_replicate_size(data_parallel_replicate_size, data_parallel_size)
        self.tensor_parallel_plan = tensor_parallel_plan
        self.save_distributed_checkpoint = save_distributed_checkpoint
        if pretrained is not None and not os.path.exists(pretrained):
            raise FileNotFoundError(
                f"pretrained={str(pretrained)!r} does not exist: pass a Hugging Face model directory, a "
                ".safetensors file, a pipe_tp checkpoint directory or a Lightning checkpoint file."
            )
        self.pretrained = None if pretrained is None else os.fspath(pretrained)
        self.pretrained_prefix = pretrained_prefix
        self.timeline = TimelineRecording(
            timeline or os.environ.get("LIGHTNING_PIPE_TIMELINE") or None, timeline_steps
        )
        self.faults = FaultHandling()
        self._mesh: ParallelMesh | None = None
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

    # ------------------------------------------------------------------ what this rank is
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
    def holds_first_stage(self) -> bool:
        if self._runtime is None:  # before setup: stage 0 is on pipeline rank 0 in every placement
            return self.pp_rank == 0
        return self._runtime.holds_first_stage

    @property
    def holds_last_stage(self) -> bool:
        if self._runtime is None:  # the last stage is on the last pipeline rank in every placement
            return self.pp_rank == self.mesh.layout.pipeline_parallel_size - 1
        return self._runtime.holds_last_stage

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel replica index: what to shard the data by (with
        :attr:`data_parallel_world_size`). Ranks of one pipeline or tensor group share it."""
        return self.mesh.coordinates.dp_rank

    @property
    def data_parallel_world_size(self) -> int:
        """The number of data-parallel replicas, each loading its own part of the data."""
        return self.mesh.layout.data_parallel_size

    # ------------------------------------------------------------------ processes
    @property
    def is_distributed(self) -> bool:
        """What Lightning's accelerator connector asks a strategy it does not know: distributed, so
        the training dataloader gets a ``DistributedSampler`` (over the data axis) as under DDP."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a pipeline must see the same batch: shard data over the data axis only.
        c = self.mesh.coordinates
        return {"num_replicas": self.mesh.layout.data_parallel_size, "rank": c.dp_rank}

    @override
    def _configure_launcher(self) -> None:
        """Lightning calls this when the Trainer is built, knowing the devices and nodes but before
        any process is launched: a layout that cannot fit them is refused here, once, in the
        launching process, instead of in every launched rank."""
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = launcher(self, self._start_method)
        world = self.num_nodes * self.num_processes
        try:
            layout = ParallelLayout.resolve(
                world, self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size
            )
        except ValueError as err:
            raise MisconfigurationException(
                f"pipe_tp cannot lay out {world} processes ({self.num_processes} devices x {self.num_nodes} "
                f"nodes): {err}"
            ) from None
        try:
            check_replicate_size(self.options.data_parallel_replicate_size, layout.data_parallel_size)
        except ValueError as err:
            raise MisconfigurationException(
                f"pipe_tp cannot lay out {world} processes ({self.num_processes} devices x {self.num_nodes} "
                f"nodes) as dp={layout.data_parallel_size} x pp={layout.pipeline_parallel_size} x "
                f"tp={layout.tensor_parallel_size}: {err}"
            ) from None
        stages = layout.pipeline_parallel_size * self.virtual_stages
        if isinstance(self.partition, list | tuple) and len(self.partition) != stages:
            v = f" x virtual_stages ({self.virtual_stages})" if self.virtual_stages > 1 else ""
            raise MisconfigurationException(
                f"partition={list(self.partition)} gives {len(self.partition)} stages their layer counts, "
                f"but the pipeline has {stages} stages (pipeline_parallel_size "
                f"{layout.pipeline_parallel_size}{v} on {world} processes): give one layer count per stage."
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """The process group (from Lightning's cluster environment), then this call's fault board,
        signal watcher and mesh."""
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero(self.global_rank)
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        init_process_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device
        )
        layout = ParallelLayout.resolve(
            self.world_size, self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        )
        self.faults.start(layout, self.global_rank, self._kill_launched_processes)
        self._mesh = None
        with self.faults.naming(f"creating the process groups of the {layout} mesh"):
            self._mesh = init_mesh(layout, "cuda" if self.root_device.type == "cuda" else "cpu")

    def _kill_launched_processes(self, signum: int) -> None:
        """Record the signal for the other ranks' errors; the processes Lightning's launcher started
        from this one (ranks 1.. under ``popen``) go at once: each would otherwise print its own
        line and wait to lose a peer."""
        self.faults.report_signal(signum)
        if self.launcher is not None:
            self.launcher.kill(9)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every rank stop at the same batch: a data-parallel replica with fewer batches would
        otherwise leave its peers waiting in a step (see :mod:`lightning_pipe.batches.uneven`)."""
        if self.world_size == 1 or not isinstance(dataloader, Iterable):
            return dataloader
        stage = self.module.trainer.state.stage
        what = f"{stage.dataloader_prefix if stage is not None else ''} batches".strip()
        others = [r for r in range(self.world_size) if r != self.global_rank]
        return EvenBatches(
            dataloader, self.mesh.layout, cast(dist.ProcessGroup, dist.group.WORLD), self.root_device, what,
            warn=rank_zero_warn, naming=lambda action: self.faults.naming(action, others),
        )  # fmt: skip

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        with self.faults.naming(f"waiting for every rank at Lightning's barrier {name!r}"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        with self.faults.naming.lost_peers("receiving an object Lightning broadcasts from rank 0"):
            dist.broadcast_object_list(box, src, group=dist.group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data axis by default: ranks of one pipeline hold the same logged values."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return sync_ddp(tensor, group or self.mesh.group(MeshAxis.DATA), reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = sync_ddp(flag, dist.group.WORLD, "sum")
        return bool(flag == self.world_size) if all else bool(flag)

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
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _SUPPORTED_PRECISION:
            raise MisconfigurationException(
                f"precision={precision!r} is not supported by the pipe_tp strategy yet; use one of "
                f"{list(_SUPPORTED_PRECISION)} (for 16-bit training on GPUs, 'bf16-mixed')."
            )

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
        plugin = self.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            fused = [
                type(o).__name__ for o in self.optimizers if getattr(o, "_step_supports_amp_scaling", False)
            ]
            if fitting and fused:
                # Such an optimizer unscales inside its own step, where no rank can agree the check.
                raise MisconfigurationException(
                    f'precision="16-mixed" under pipe_tp agrees the gradient scaler\'s inf check over every '
                    f"stage before stepping, which the fused optimizer(s) {fused} bypass (they unscale "
                    "inside their own step). Use the optimizer without fused=True, or precision='bf16-mixed'."
                )
            if fitting and self.runtime.gradient_sharding is GradientSharding.PARAMETERS:
                raise MisconfigurationException(
                    'precision="16-mixed" with shard_parameters=True is not supported yet: each '
                    "data-parallel rank holds only its shards of the gradients, and the gradient "
                    "scaler's inf check would have to be agreed over the data axis too. Use "
                    'precision="bf16-mixed" (parameters gathered in bfloat16) or "32-true", or '
                    "shard_parameters=False."
                )
            if fitting and self.runtime.gradient_sharding is GradientSharding.OPTIMIZER_STATE:
                raise MisconfigurationException(
                    'precision="16-mixed" with shard_optimizer_state=True is not supported yet: each '
                    "replica holds only its slice of the gradients, and the gradient scaler's inf check "
                    'would have to be agreed over the replicas too. Use precision="bf16-mixed" or '
                    '"32-true", or shard_optimizer_state=False.'
                )
            # fp16: every rank of the model skips or steps together (runtime/grad_scaler.py).
            if not isinstance(plugin.scaler, AgreedGradScaler):
                device = self.root_device.type
                plugin.scaler = AgreedGradScaler.like(plugin.scaler, device, self.mesh.model_group)
            else:
                plugin.scaler.group = self.mesh.model_group
        if isinstance(plugin, GlobalNormClipping):
            plugin.clip_by_global_norm = self._clip_by_global_norm
        elif fitting and trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "norm":
            raise MisconfigurationException(
                f"gradient_clip_val={trainer.gradient_clip_val} under pipe_tp clips by the norm over every "
                f"stage, which the precision plugin {type(plugin).__name__} cannot do (it would clip each "
                "stage by its own norm, unlike one device). Use Trainer(precision=...) with one of "
                f"{list(_SUPPORTED_PRECISION)}, or clip inside the model."
            )

    def _clip_by_global_norm(self, max_norm: float) -> torch.Tensor:
        # Looked up per call: the plugin keeps no reference to one Trainer call's runtime.
        return self.runtime.clip_grad_norm_(max_norm)

    def _loss_scaler(self) -> Any:
        """fp16's loss scaling (the precision plugin's gradient scaler), else ``None``."""
        plugin = self.precision_plugin
        scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
        return scaler.scale if scaler is not None else None

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
        learn_step_inputs(
            self.module, step_name, args, view.huggingface.model, view.step_inputs, self._gather_objects
        )

    def _gather_objects(self, obj: Any) -> dict[int, Any]:
        """``obj`` from every rank of this rank's model replica, by global rank: only the ranks
        sharing a batch learn its roles together (another replica may learn at another step)."""
        if not dist.is_initialized() or self.world_size == 1:
            return {self.global_rank: obj}
        mesh = self.mesh
        ranks = mesh.layout.replica_ranks(mesh.coordinates.dp_rank)
        everyone: list[Any] = [None] * len(ranks)
        others = [r for r in ranks if r != self.global_rank]
        with self.faults.naming("agreeing on which batch tensors the step gives the model", others):
            dist.all_gather_object(everyone, obj, group=mesh.model_group)
        return dict(zip(ranks, everyone, strict=True))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.module.trainer
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
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
                scale_loss=self._loss_scaler(),
                recorder=self.timeline.recorder_for(trainer.global_step, self.global_rank),
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
        recorder = self.timeline.recorder_for(self.module.trainer.global_step, self.global_rank)
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
            recorder.add_span("optimizer step", closure_end[-1], time.perf_counter())
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


def _check_sizes(pp: object, tp: object, dp: object) -> None:
    """Each size on its own (the world size is known only when the Trainer has its devices)."""
    check_count("tensor_parallel_size", tp)
    for name, value in (("pipeline_parallel_size", pp), ("data_parallel_size", dp)):
        if value != "auto":
            check_count(name, value, also="'auto'")
