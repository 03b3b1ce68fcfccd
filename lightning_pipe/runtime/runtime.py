"""``ParallelRuntime``: train one model over a dp x pp x tp mesh, in plain torch.

Given a module, its ordered pipeline layers and a :class:`~lightning_pipe.mesh.ParallelMesh`, the
runtime owns everything between "here is a batch" and "the gradients are ready for
``optimizer.step()``": the partition into stages, tensor-parallel slicing, tied-weight groups,
materialisation of a meta-built stage, the split of each batch into micro-batches and their loss
weights, the check that a replica's ranks hold one batch (and, once, that ``forward`` is the
chained layers), the schedule, deferred BatchNorm, the data-parallel reducer (or FSDP2 over the
data axis, ``shard_parameters``), the sum of tied copies, global-norm clipping and the checkpoint
of what this rank holds. It takes its process groups from the mesh and imports nothing from
Lightning; ``PipeTPStrategy`` adapts Lightning's hooks onto it, and a training loop without a
Trainer drives it directly (``examples/train_engine.py``).

Its public API, what both call:

* construction: ``ParallelRuntime(module, layers, mesh, device, options, *, seed, init, weights,
  sample, board, pipeline_input)``;
* one optimizer step: :meth:`begin_accumulation` (after zeroing the gradients), then
  :meth:`train_batch` per batch of the accumulation window (``final=True`` on the last), then
  optionally :meth:`clip_grad_norm_`, then ``optimizer.step()``;
* evaluation: :meth:`eval_batch` per batch; :meth:`agree_end` where a loop ends, so that a rank
  whose data ran out first stops with its peers;
* optimizers: :meth:`keep_own` (the optimizer built over the whole model keeps this rank's
  parameters; ZeRO-1 shards it), :meth:`logical` (what checkpoints see);
* checkpoints: :meth:`save_checkpoint`, :meth:`load_checkpoint`, and :attr:`part` for callers
  that compose their own (:mod:`lightning_pipe.checkpoint.rank_state`);
* what this rank holds: :attr:`partition`, :attr:`stage_indices`, :attr:`holds_first_stage`,
  :attr:`holds_last_stage`, :attr:`layers`, :attr:`parameters`, :attr:`holdings`,
  :meth:`other_stages_tensors`, :meth:`describe`, :attr:`warnings`;
* :meth:`close` at the end of a run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.batches.agreement import StepCheckError, StepIdentity, agree, fingerprint
from lightning_pipe.batches.forward_contract import check_forward
from lightning_pipe.batches.microbatch import (
    as_layer_arguments,
    batch_size,
    microbatch_sizes,
    signature,
    split_microbatches,
)
from lightning_pipe.checkpoint import rank_state
from lightning_pipe.checkpoint.optimizer_view import keep_own
from lightning_pipe.construction.materialize import InitFn
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.data_parallel.sharded_optimizer import LogicalOptimizer
from lightning_pipe.data_parallel.sharded_state import ShardedStateView
from lightning_pipe.execution.batchnorm import DeferredBatchNorm, batch_norm_layers, normalising_by_batch
from lightning_pipe.execution.executor import ActionRecorder, PipelineExecutor
from lightning_pipe.execution.layers import bind_layers
from lightning_pipe.execution.p2p import PipelineCommunicationError
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.execution.seeding import layer_seed
from lightning_pipe.faults.board import FaultBoard, lost_connection
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.partition.balance import measures_time
from lightning_pipe.partition.model import PipelinePartition, partition_model
from lightning_pipe.partition.profile import profile_layers
from lightning_pipe.runtime.batch import (
    BatchResult,
    Head,
    Microbatch,
    count_microbatches,
    default_pipeline_input,
)
from lightning_pipe.runtime.batch_faults import batch_collectives_named
from lightning_pipe.runtime.dropout_notice import describe_dropout, dropout_sources
from lightning_pipe.runtime.gradients import Gradients
from lightning_pipe.runtime.holdings import Holdings
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.runtime.model_recompute import ModelCheckpointing, take_over_checkpointing
from lightning_pipe.runtime.notices import (
    BATCH_NORM_NOT_DEFERRED,
    PARAMETERS_ONE_REPLICA,
    SHARDING_ONE_REPLICA,
    batch_norm_mixes,
    batch_norm_refused,
)
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.runtime.prepare import Preparation, Preparer, other_stages_tensors, preparation_of
from lightning_pipe.runtime.sharding import describe_sharding, refuse_parallelized, shard_parameters
from lightning_pipe.schedule.actions import PipelineSchedule
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.skip.plan import SkipLayers
from lightning_pipe.tensor_parallel.dropout import RegionDropout
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from lightning_pipe.tensor_parallel.regions import sequence_parallel_suspended

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class ParallelRuntime:
    """dp x pp x tp training of ``module`` on this rank (see the module docstring).

    Args:
        module: the whole model (built eagerly, or with meta parameters).
        layers: its pipeline layers in order (submodules of ``module``).
        mesh: this rank's mesh; every group is taken from it.
        device: where this rank's stage lives.
        options: micro-batches, schedule, partition, recomputation, tensor-parallel plan, ...
        seed: the seed of a meta-built model's initial values and of tensor-parallel dropout;
            global rank 0's is used on every rank (``None``: its ``torch.initial_seed()``).
        init: called for each module with tensors to initialise instead of its
            ``reset_parameters()`` (meta-built models).
        weights: pretrained files a meta-built model starts from.
        sample: one micro-batch's pipeline input (what the first layer takes), which
            ``partition="time"`` times the layers on; not needed otherwise.
        board: the job's fault board: a collective or exchange that loses its peer names who
            stopped and how.
        hooks: how to read a model that is more than its layers chained (what enters the first
            layer, how each layer is called, how ``forward`` is checked, the loss items of each
            sample); see :class:`~lightning_pipe.runtime.hooks.ModelHooks`.
        trains: whether this runtime will train (``False``: evaluation only, where what only
            training does unlike one device, BatchNorm under micro-batching, is not refused).
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Sequence[nn.Module],
        mesh: ParallelMesh,
        device: torch.device,
        options: RuntimeOptions | None = None,
        *,
        seed: int | None = None,
        init: InitFn | None = None,
        weights: WeightFiles | None = None,
        sample: Any = None,
        board: FaultBoard | None = None,
        hooks: ModelHooks | None = None,
        trains: bool = True,
    ) -> None:
        self.module, self.mesh, self.device = module, mesh, device
        self.options = options or RuntimeOptions()
        self.naming = CollectiveNaming(mesh.rank, str(mesh.coordinates), board)
        """Names this rank and the operation in a failing collective's error (the caller may use
        it for its own collectives)."""
        self.hooks = hooks or ModelHooks()
        self._pipeline_input = self.hooks.pipeline_input or default_pipeline_input
        layout, v = mesh.layout, self.options.virtual_stages
        done = preparation_of(module, layout, self.options.partition, v)
        self.first_setup = done is None
        asked = self.options.recompute_mode
        taken = take_over_checkpointing(module.named_modules())
        if done is not None and done.model_checkpointing is not None:
            taken = done.model_checkpointing.merged(taken)
        self.model_checkpointing: ModelCheckpointing | None = taken
        """The model's own gradient checkpointing that this runtime took over (turned off inside the
        stages, honoured by ``recompute``), if the model had it on."""
        self._asked_recompute = asked
        if taken is not None:
            self.options = dataclasses.replace(self.options, recompute=taken.mode(asked))
        # The model's own layers inside any Stash / Pop wrappers; later setups get no layers and
        # keep the first one's skips.
        layers, skips = SkipLayers.of(layers)
        self.warnings: list[str] = []
        """Once-per-run warnings, shown on global rank 0 (every rank has them)."""
        if done is None and v > 1 and len(layers) < layout.pipeline_parallel_size * v:
            raise ConfigurationError(
                f"The model has {len(layers)} pipeline layers but interleaved 1F1B asks for "
                f"pipeline_parallel_size ({layout.pipeline_parallel_size}) x virtual_stages ({v}) = "
                f"{layout.pipeline_parallel_size * v} stages, each needing at least one layer. Lower "
                "virtual_stages or pipeline_parallel_size, or return finer-grained layers from "
                "configure_pipeline()."
            )
        if done is None:
            refuse_parallelized(module)
            if not skips.plan.empty and self.options.sequence_parallel and layout.tensor_parallel_size > 1:
                raise ConfigurationError(
                    "pipe_tp: skip connections (Stash / Pop, @skippable) cannot be combined with "
                    "sequence_parallel=True yet: a stashed tensor inside a sequence-parallel region is "
                    "one tensor rank's part of the sequence. Turn sequence_parallel off for this model."
                )
            times = self._layer_times(skips.wrap(bind_layers(layers, self.hooks.layer_calls)), sample)
            partition = partition_model(
                module, layers, layout.pipeline_parallel_size * v, self.options.partition, times
            )
        else:
            partition = done.partition
        self.partition: PipelinePartition = partition
        """Which layers each stage holds (tied weights and aliases included)."""
        self.stage_indices = partition.stages_of_rank(mesh.coordinates.pp_rank, layout.pipeline_parallel_size)
        """The stages this rank holds; every stage-dependent choice reads this."""
        mixed_batch_norms = self._batch_norms_mixing(partition)
        if mixed_batch_norms and trains and not self.options.allow_batch_norm_microbatches:
            # Refused before anything is split, sliced or trained.
            raise ConfigurationError(batch_norm_refused(mixed_batch_norms, self.options.num_microbatches))
        tied = self._tied_groups(partition)  # collective (new_group): before the seed's broadcast
        materialized: frozenset[int] = frozenset()
        if done is None:
            seed = self._agreed_seed(seed)
            preparer = Preparer(
                module,
                mesh,
                device,
                self.options,
                seed,
                init,
                weights,
                self.naming,
                tied,
                self.stage_indices,
                splits_sequence=self.hooks.splits_sequence,
                recompute_from_model=taken is not None and asked is RecomputeMode.NEVER,
            )
            done, materialized = preparer.run(partition, layers)
            done.skips = skips
            self.warnings += preparer.warnings
        self.preparation: Preparation = done
        done.model_checkpointing = taken
        skips = done.skips or skips
        """How the module was split and sliced (kept on the module for later runtimes)."""
        self.layers: list[nn.Module] = [module.get_submodule(name) for name in partition.layer_names]
        """The pipeline layers (tensor-parallel slices where sliced), as the partition names them."""
        self._executed = skips.wrap(bind_layers(self.layers, self.hooks.layer_calls if self.layers else None))
        """The layers as the executor applies them (with their calls, where the hooks give some, and
        their skip connections' wrappers)."""
        self.skip_routes = skips.plan.routes(partition.stage_of_layer)
        """The skip connections between stages (all of the pipeline's, not only this rank's)."""
        own = self.own_layers
        if layout.data_parallel_size > 1 and done.fully_sharded is None:
            c = mesh.coordinates
            src = layout.rank_of(0, c.pp_rank, c.tp_rank)
            # Materialised tensors are equal on every replica by construction: not sent again.
            # (Sharded parameters are not sent at all: each data-parallel rank holds its own shard.)
            tensors = [t for layer in own for t in (*layer.parameters(), *layer.buffers())]
            with self.naming("making the replicas' weights equal"):
                broadcast_parameters(
                    [t for t in tensors if id(t) not in materialized], mesh.group(MeshAxis.DATA), src
                )
        self.fully_sharded: FullyShardedStages | None = shard_parameters(
            done,
            self.layers,
            self.stage_indices,
            module,
            mesh,
            self.options,
            self.naming,
        )
        """This rank's stages under FSDP2 (``shard_parameters`` with several data-parallel ranks)."""
        executed: dict[int, Sequence[nn.Module]] = {
            s: [self._executed[i] for i in partition.layer_range(s)] for s in self.stage_indices
        }
        if self.fully_sharded is not None:
            # The executor runs each stage's FSDP root, which applies the layers.
            self.fully_sharded.bind(executed)
            executed = {s: [self.fully_sharded.roots[s]] for s in self.stage_indices}
        owned = {id(p): p for layer in own for p in layer.parameters() if p.requires_grad}
        self.parameters: list[nn.Parameter] = list(owned.values())
        """This rank's trainable parameters (its stages' layers, tensor slices, data-parallel
        shards under ``shard_parameters``)."""
        self.executor = PipelineExecutor(
            executed,
            partition.num_stages,
            mesh.pipeline_peers,
            device,
            self.options.recompute,
            timeout=self.options.timeout,
            check_finite=self.options.check_finite,
            board=board,
            skips=self.skip_routes,
            skip_declarations={
                s: skips.plan.declared_by(partition.layer_range(s)) for s in self.stage_indices
            },
        )
        self._schedules: dict[tuple[int, bool], PipelineSchedule] = {}
        copies = [
            (module.get_parameter(done.tied_paths.get(name, name)), group, counts)
            for name, group, counts in tied
        ]
        self.gradients = Gradients(
            self.parameters,
            copies,
            mesh,
            self.naming,
            self.options.bucket_cap_mb,
            shard=self.options.shard_optimizer_state,
            fully_sharded=self.fully_sharded,
            overlap_param_gather=self.options.overlap_param_gather,
            summed_over_tensor=[
                p
                for name in done.summed_over_tensor
                for p in _parameters_named(module, name)
                if id(p) in owned
            ],
        )
        """This rank's gradients from the first backward of a window to the optimizer step."""
        if self.options.shard_optimizer_state and layout.data_parallel_size == 1 and self.first_setup:
            self.warnings.append(SHARDING_ONE_REPLICA)
        if self.options.shard_parameters and layout.data_parallel_size == 1 and self.first_setup:
            self.warnings.append(PARAMETERS_ONE_REPLICA)
        if self.options.sequence_parallel and layout.tensor_parallel_size == 1 and self.first_setup:
            self.warnings.append(
                "pipe_tp: sequence_parallel=True has no effect with tensor_parallel_size=1 (the sequence is "
                "split over the tensor ranks, and there is one) but to turn on layer-seeded dropout; for "
                "that alone, say layer_seeded_dropout=True."
            )
        self.batch_norm: DeferredBatchNorm | None = None
        if mixed_batch_norms and self.options.allow_batch_norm_microbatches:
            self.warnings.append(batch_norm_mixes(mixed_batch_norms))
        if batch_norm_layers(self.layers):
            if self.options.deferred_batch_norm:
                self.batch_norm = DeferredBatchNorm(batch_norm_layers(own))
            else:
                self.warnings.append(BATCH_NORM_NOT_DEFERRED)
        for text in self.warnings:
            self._warn(text)
        self._checked_kinds: set[Any] = set()
        """The kinds of first micro-batch (``ModelHooks.probe_kind``; one kind, ``None``, without
        it) whose forward has been checked."""
        self._warned_small_batch = False
        self._late_checkpointing_checked = False
        self._batches = 0
        self.training_batches = 0
        """Training batches run so far: the batch key of layer-seeded dropout when ``train_batch``
        is given none (the Lightning adapter gives the loop's count, which a resumed run restores)."""

    def _batch_norms_mixing(self, partition: PipelinePartition) -> list[str]:
        """The names of the BatchNorm modules in the pipeline's layers when a batch is split into
        several micro-batches (each then normalised by its own statistics); none with one. A
        BatchNorm in eval mode (frozen statistics, as fine-tuning often keeps them; Lightning
        leaves a submodule's mode as the user set it) normalises by its running statistics: exact."""
        if self.options.num_microbatches == 1:
            return []
        layers = [self.module.get_submodule(name) for name in partition.layer_names]
        names = {id(m): n for n, m in self.module.named_modules()}
        return [names[id(m)] for m in normalising_by_batch(layers) if m.training]

    # ------------------------------------------------------------------ what this rank holds
    @property
    def own_layers(self) -> list[nn.Module]:
        """The pipeline layers of the stages this rank holds, in order."""
        return [self.layers[i] for s in self.stage_indices for i in self.partition.layer_range(s)]

    @property
    def holdings(self) -> Holdings:
        """Whole and per-rank parameter elements of every stage."""
        assert self.preparation.holdings is not None
        return self.preparation.holdings

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.partition.num_stages - 1 in self.stage_indices

    @property
    def part(self) -> rank_state.RankPart:
        """What this rank holds, as checkpoints see it."""
        return rank_state.RankPart(
            self.module,
            self.partition,
            self.stage_indices,
            self.mesh.layout,
            self.mesh.coordinates,
            frozenset(id(p) for p in self.parameters),
            is_writer=self.mesh.rank == 0,
        )

    def other_stages_tensors(self) -> set[int]:
        """``id()`` of the tensors only other ranks' stages hold (meta, or never trained here)."""
        return other_stages_tensors(self.partition, self.layers, self.stage_indices)

    def keep_own(self, optimizer: OptimizerT) -> OptimizerT:
        """``optimizer``, built over the whole module's parameters (other stages' meta tensors
        included, as ``model.parameters()`` gives them), keeping only this rank's; its groups stay
        described in whole-model terms, so that its checkpoints load at any layout and on one
        device (:mod:`lightning_pipe.checkpoint.optimizer_view`). Under ``shard_optimizer_state``
        it then steps this replica's slices only, and the next forward of each layer waits for the
        all-gather of its updated parameters. Returns it."""
        others = self.other_stages_tensors()
        own = {id(p) for p in self.module.parameters() if id(p) not in others and not p.is_meta}
        keep_own(optimizer, self.module, own)
        # The modules the executor calls (a layer with its call, BoundLayer) hold the layers' parameters.
        executed = [self._executed[i] for s in self.stage_indices for i in self.partition.layer_range(s)]
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.gradients.shard_optimizer(optimizer, executed, names)
        return optimizer

    def wait_for_parameters(self) -> None:
        """Under ZeRO-1, wait for the updated parameters' all-gathers still in flight after the
        optimizer's step (the next forward waits for them layer by layer; reads in between are
        guarded): call it before reading the weights through an alias made before the step (the
        guard knows the parameters, not their aliases) or from another Python thread (the guard,
        a torch-function mode, sees this thread's calls only; this call is safe from any thread).
        Nothing to do otherwise."""
        self.gradients.wait_for_parameters()

    def logical(self, optimizer: torch.optim.Optimizer, *, whole_everywhere: bool = False) -> Any:
        """``optimizer`` as checkpoints see it: under ``shard_optimizer_state``, a view over the
        real parameters with the unsharded state (assembling it is collective over the replicas);
        under ``shard_parameters``, a view whose state is gathered whole (collective over the data
        axis) on the first replica only, or on every rank with ``whole_everywhere`` (a single-file
        checkpoint's gather)."""
        sharded = self.gradients.sharded.get(id(optimizer))
        if sharded is not None:
            return LogicalOptimizer(sharded)
        if self.fully_sharded is not None:
            keep = whole_everywhere or self.mesh.coordinates.dp_rank == 0
            # A single-file gather goes on over the tensor group (on NCCL, device tensors only).
            return ShardedStateView(optimizer, keep_whole=keep, to_host=not whole_everywhere)
        return optimizer

    def describe(self, num_microbatches: int | None = None) -> str:
        """The start-of-run layout log."""
        layout, done = self.mesh.layout, self.preparation
        per_rank = self.holdings.per_rank if layout.tensor_parallel_size > 1 else None
        m = num_microbatches or self.options.num_microbatches or f"auto (2 x {layout.pipeline_parallel_size})"
        v = self.options.virtual_stages
        virtual = f" ({v} stages per rank)" if v > 1 else ""
        taken = self.model_checkpointing
        recompute_note = taken.describe(self._asked_recompute) if taken is not None else ""
        text = (
            f"pipe_tp: layout {layout} (world {layout.world_size}), schedule "
            f"{self.options.schedule_kind.value}{virtual}, micro-batches {m}, recompute "
            f"{self.executor.recompute.value}{recompute_note}\n"
            + self.partition.describe(self.layers, per_rank, layout.pipeline_parallel_size)
        )
        if done.slicing:
            text += f"\n{done.slicing}"
        if self.skip_routes:
            routes = ", ".join(
                f"{r.producer} -> {r.consumer} ({', '.join(r.names)})" for r in self.skip_routes
            )
            text += f"\n  skip connections sent between stages: {routes}"
        text += describe_dropout(dropout_sources(self.module, self.layers), self.options.seeds_layers)
        text += describe_sharding(self.options, layout.data_parallel_size, self.fully_sharded)
        if done.built_on_meta:
            text += (
                "\n  built on the meta device: each rank holds only its own stages' tensors (and tensor "
                "slices); other stages' parameters are meta tensors, without storage"
            )
        return text

    # ------------------------------------------------------------------ one step
    def schedule_for(self, num_microbatches: int, training: bool) -> PipelineSchedule:
        """The schedule of ``num_microbatches`` micro-batches (forward-only unless ``training``)."""
        key = (num_microbatches, training)
        if key not in self._schedules:
            kind, v = self.options.schedule_kind, self.options.virtual_stages
            pairs = [(r.producer, r.consumer) for r in self.skip_routes]
            self._schedules[key] = build_schedule(
                kind, self.partition.num_stages, *key, virtual_stages=v, skips=pairs
            )
        return self._schedules[key]

    def begin_accumulation(self) -> None:
        """Start an optimizer step's accumulation window (call after zeroing the gradients)."""
        self.gradients.begin()

    def train_batch(
        self,
        batch: Any,
        head: Head,
        *,
        final: bool = True,
        loss_weight: float = 1.0,
        step: StepIdentity | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        recorder: ActionRecorder | None = None,
        training_batch: int | None = None,
    ) -> BatchResult:
        """Forward and backward of ``batch`` over the pipeline; its gradients accumulate.

        Args:
            batch: the whole batch, the same on every rank of the replica (checked).
            head: on the last stage, ``head(output, microbatch)`` returns the micro-batch's scalar
                loss; a ``head.results()`` method's return reaches every rank (:class:`BatchResult`).
            final: the last batch of the accumulation window: its backward overlaps the
                data-parallel averaging, and the gradients are finished after it.
            loss_weight: the batch's share of the window's loss (``1 / accumulation``); each
                micro-batch's loss is weighted by its share of the batch's samples times this.
            step: which step this is, for the messages of the batch agreement.
            scale_loss: applied to each weighted loss before its backward (fp16: a gradient
                scaler's ``scale``; unscale with
                :class:`~lightning_pipe.runtime.grad_scaler.AgreedGradScaler`).
            recorder: the timeline's hook for this batch's actions.
            training_batch: the batch's index in training (over epochs): with layer-seeded
                dropout, its masks follow from it (default: :attr:`training_batches`).
        """
        if training_batch is not None:
            self.training_batches = training_batch
        if not self._late_checkpointing_checked:
            self._late_checkpointing_checked = True
            self._take_over_late_checkpointing()
        try:
            with self._collectives_named():
                return self._run_batch(batch, head, True, final, loss_weight, step, scale_loss, recorder)
        finally:
            self.training_batches += 1

    def eval_batch(
        self,
        batch: Any,
        head: Head,
        *,
        step: StepIdentity | None = None,
        recorder: ActionRecorder | None = None,
    ) -> BatchResult:
        """Forward of ``batch`` over the pipeline; ``head(output, microbatch)`` runs on the last
        stage (its returns are the result's ``outputs`` there)."""
        with self._collectives_named():
            return self._run_batch(batch, head, False, False, 1.0, step, None, recorder)

    def _collectives_named(self) -> AbstractContextManager[None]:
        """A peer lost inside a collective the layers drive (tensor parallelism's, FSDP2's) is
        named like one lost in the runtime's own collectives (:mod:`.batch_faults`)."""
        data = None
        if self.fully_sharded is not None:
            data = dist.get_process_group_ranks(self.mesh.group(MeshAxis.DATA))
        return batch_collectives_named(self.naming, data)

    def _layer_seeds(self) -> Callable[[int, int], list[int]]:
        """This training batch's seeds for each layer of a stage on a micro-batch (by the layers'
        global indices: equal for a layer whichever stage and rank hold it)."""
        seed, batch, partition = self.preparation.seed, self.training_batches, self.partition

        def seeds(stage_index: int, microbatch: int) -> list[int]:
            return [layer_seed(seed, batch, microbatch, k) for k in partition.layer_range(stage_index)]

        return seeds

    def agree_end(self, what: str) -> None:
        """Where a loop ends (``"end of validation"``): every rank of the replica agrees, so that a
        rank whose data ran out first stops with its peers instead of leaving them in a step."""
        self._agree(StepIdentity(what, -1), None)

    def _run_batch(
        self,
        batch: Any,
        head: Head,
        training: bool,
        final: bool,
        loss_weight: float,
        step: StepIdentity | None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
        recorder: ActionRecorder | None,
    ) -> BatchResult:
        self._batches += 1
        step = step or StepIdentity("train_batch" if training else "eval_batch", self._batches)
        m, fewer = count_microbatches(
            batch, self.options.num_microbatches, self.mesh.layout.pipeline_parallel_size
        )
        if fewer and not self._warned_small_batch:
            self._warned_small_batch = True
            self._warn(
                f"pipe_tp: a batch of {m} samples is smaller than num_microbatches="
                f"{self.options.num_microbatches}; it runs as {m} micro-batches (warned once)."
            )
        sizes = microbatch_sizes(batch_size(batch), m)
        pieces = split_microbatches(batch, m)
        counts, replica_items, counted = self._loss_counts(batch, sizes, step, training)
        local = sum(counts)  # this replica's loss items (or samples)
        items = counts if counted and local > 0 else None
        # Shares of the items; by samples for a replica without items in a global batch that has
        # some (data-parallel training: its losses weigh nothing, dp_factor is 0 below) and for
        # the logged values of such a part.
        shared = counts if local > 0 else [float(n) for n in sizes]
        whole = sum(shared)
        microbatches = [
            Microbatch(i, pieces[i], sizes[i], shared[i] / whole, None if items is None else items[i])
            for i in range(m)
        ]
        inputs = [as_layer_arguments(self._pipeline_input(mb.data)) for mb in microbatches]
        self._check_before(step, batch, inputs[0])
        # By items, the replicas' gradients are averaged, so each replica's losses are weighted by
        # its share of the global batch's items times the number of replicas (1 when the replicas
        # hold as many items each): the average is then the global batch's mean.
        dp_factor = (
            1.0 if replica_items is None else local * self.mesh.layout.data_parallel_size / replica_items
        )

        def end(output: Any, i: int) -> Any:
            # The loss may read parameters outside the layers (the pre-hooks wait for the layers').
            self.gradients.wait_for_parameters()
            return head(output, microbatches[i])

        deferred = self.batch_norm if training else None
        if deferred is not None:
            deferred.begin()
        try:
            run = self.executor.run(
                self.schedule_for(m, training),
                self.mesh.coordinates.pp_rank,
                inputs=inputs if self.holds_first_stage else None,
                head=end if self.holds_last_stage else None,
                weights=[mb.share * dp_factor * loss_weight for mb in microbatches] if training else None,
                signatures=[signature(x) for x in inputs],
                recorder=recorder,
                before_last_backward=self.gradients.arm if training and final else None,
                scale_loss=scale_loss if training else None,
                layer_seeds=self._layer_seeds() if training and self.options.seeds_layers else None,
            )
        except PipelineCommunicationError as err:
            if deferred is not None:
                deferred.end()  # no commit of a failed step's statistics
            if not lost_connection(str(err)):  # a deadline: the peer may wait on a rank that failed
                self.naming.note_first_failure(err)
            raise
        except BaseException:
            if deferred is not None:
                deferred.end()
            raise
        if deferred is not None:  # commit ends the deferral
            dp = self.mesh.layout.data_parallel_size > 1
            with self.naming("summing BatchNorm statistics over the data-parallel group"):
                deferred.commit(self.mesh.group(MeshAxis.DATA) if dp else None)
        if training and final:
            self.gradients.finish()
        if not training and self.fully_sharded is not None:
            self.fully_sharded.end_evaluation()  # no backward frees what the forwards gathered
        payload: dict[str, Any] = {}
        if self.holds_last_stage:
            if training:
                payload["loss"] = sum(
                    float(run.outputs[mb.index].detach().double()) * mb.share for mb in microbatches
                )
            results = getattr(head, "results", None)
            payload["results"] = results() if callable(results) else None
        payload = self._from_last_stage(payload)
        return BatchResult(
            loss=payload.get("loss"),
            results=payload.get("results"),
            outputs=run.outputs,
            num_microbatches=m,
            peak_stashed=run.peak_stashed,
            peak_activation_bytes=run.peak_activation_bytes,
        )

    def _loss_counts(
        self, batch: Any, sizes: Sequence[int], step: StepIdentity, training: bool
    ) -> tuple[list[float], float | None, bool]:
        """Each micro-batch's loss items (its samples, unless the hooks count items), when items
        are counted and training averages gradients over several replicas the global batch's, and
        whether items were counted."""
        items = self.hooks.loss_items(batch) if self.hooks.loss_items is not None else None
        if items is None:
            return [float(n) for n in sizes], None, False
        total = sum(sizes)
        if not isinstance(items, torch.Tensor) or tuple(items.shape) != (total,):
            raise ValueError(
                f"loss_items must give one count per sample of the batch (a tensor of shape ({total},)), "
                f"got {tuple(items.shape) if isinstance(items, torch.Tensor) else type(items).__name__}."
            )
        counts = [float(chunk.sum()) for chunk in torch.split(items.detach().double().cpu(), list(sizes))]
        empty = f"The batch of {step} holds no loss items (every label is ignored, e.g. -100 everywhere"
        if self.mesh.layout.data_parallel_size == 1 or not training:
            if sum(counts) <= 0 and training:
                raise ValueError(
                    f"{empty}): its mean loss is undefined, on one device too. Filter such batches out "
                    "before they reach the model."
                )
            # Evaluation of a batch without items: weighted by samples (its loss is 0, not 0/0).
            return counts, None, True
        # Summed before any refusal: a replica whose part holds no items must not stop alone while
        # the others wait in this all-reduce; only a global batch without items is refused.
        global_items = torch.tensor([sum(counts)], dtype=torch.float64, device=self.device)
        with self.naming("summing the batch's loss items over the data-parallel group"):
            dist.all_reduce(global_items, group=self.mesh.group(MeshAxis.DATA))
        if float(global_items) <= 0:
            raise ValueError(
                f"{empty} on every data-parallel replica): its mean loss is undefined, on one device "
                "too. Filter such batches out before they reach the model."
            )
        return counts, float(global_items), True

    def _check_before(self, step: StepIdentity, batch: Any, probe: Any) -> None:
        """Stop every rank of the replica, with one message, if its ranks are about to run
        different batches or (on the first batch of each kind) ``forward`` is not the chained
        layers."""
        problem = None
        # The kind only when checking: a model's probe_kind may read the device (a host sync).
        kind = None
        if self.options.check_forward and self.hooks.probe_kind is not None:
            kind = self.hooks.probe_kind(probe)
        run = self.options.check_forward and kind not in self._checked_kinds
        kinds_vary = self.options.check_forward and self.hooks.probe_kind is not None
        if kinds_vary and self.fully_sharded is not None:
            # The check calls the stage's FSDP units, whose gathers are collective over the data
            # axis; replicas meet a new kind of batch at different steps: when one needs the check,
            # every data-parallel rank runs it (again, on its own probe), so the gathers pair up.
            flag = torch.tensor([int(run)], dtype=torch.int32, device=self.device)
            with self.naming("agreeing over the data-parallel group whether to check the forward"):
                dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self.mesh.group(MeshAxis.DATA))
            run = bool(flag.item())
        if run:
            self._checked_kinds.add(kind)
            # On the whole probe, without sequence parallelism: what one device computes.
            with sequence_parallel_suspended():
                if self.hooks.check_forward is not None:
                    problem, warning = self.hooks.check_forward(probe, self.own_layers)
                else:
                    problem, warning = check_forward(self.module.forward, self._executed, self.module, probe)
            if warning is not None:
                self._warn(warning)
        tp = self.mesh.layout.tensor_parallel_size
        if problem is None and self.options.sequence_parallel and tp > 1:
            problem = _indivisible_sequence(probe, tp)
        self._agree(step, batch, problem)
        if run and self.options.sequence_parallel and tp > 1 and self.hooks.check_sequence is not None:
            # After the agreement: every tensor rank holds this batch, so the check's gathers pair up;
            # its finding is agreed on like the others, so that every rank stops with it.
            with self.naming("checking the layers under sequence parallelism (tensor group)"):
                found = self.hooks.check_sequence(probe, self.own_layers, self.mesh.group(MeshAxis.TENSOR))
            self._agree(step, batch, found)

    def _agree(self, step: StepIdentity, batch: Any, problem: str | None = None) -> None:
        group = self.mesh.model_group
        if dist.get_world_size(group) == 1:
            if problem is not None:
                raise StepCheckError(problem)
            return
        layout = self.mesh.layout

        def describe(rank: int) -> str:
            c = layout.coordinates(rank)
            return f"pp_rank {c.pp_rank}, tp_rank {c.tp_rank}"

        replica = layout.replica_ranks(self.mesh.coordinates.dp_rank)
        others = [r for r in replica if r != self.mesh.rank]
        with self.naming(f"checking that the replica's ranks run the same batch ({step})", others):
            agree(fingerprint(batch, step, self.device), group, describe, step, batch, problem)

    def _from_last_stage(self, payload: Any) -> Any:
        """Every rank of this pipeline gets the last stage's ``payload`` (picklable: the loss, a
        head's results), so that all ranks return the same result."""
        layout = self.mesh.layout
        if layout.pipeline_parallel_size == 1:
            return payload
        c = self.mesh.coordinates
        last = self.partition.rank_of_stage(self.partition.num_stages - 1, layout.pipeline_parallel_size)
        src = layout.rank_of(c.dp_rank, last, c.tp_rank)
        box = [payload]
        device = self.device if self.device.type == "cuda" else None
        peers = [r for r in self.mesh.pipeline_peers if r != self.mesh.rank]
        with self.naming(f"receiving the step's results from the last stage (rank {src})", peers):
            dist.broadcast_object_list(box, src=src, group=self.mesh.group(MeshAxis.PIPELINE), device=device)
        return box[0]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's and tensor slice's gradients, as one device would
        (``torch.nn.utils.clip_grad_norm_`` over the whole model); returns that norm."""
        return self.gradients.clip_(max_norm, self.device)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: str | Path,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Collective over the world: write this rank's part of the model and of each optimizer
        (and, from global rank 0, ``extra``) into the checkpoint directory ``path``, keyed by the
        unsliced model's names, so that any layout, or one device after
        ``python -m lightning_pipe.consolidate``, loads it."""
        self.wait_for_parameters()
        part = self.part
        checkpoint = {
            **(extra or {}),
            "state_dict": rank_state.model_state(part),
            "optimizer_states": [rank_state.optimizer_state(part, self.logical(o)) for o in optimizers],
        }
        with self.naming(f"saving the checkpoint {path}"):
            rank_state.write(part, path, checkpoint)

    def load_checkpoint(
        self, path: str | Path, optimizers: Sequence[torch.optim.Optimizer] = (), strict: bool = True
    ) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``path`` (any layout's) into the model and
        ``optimizers``; returns the rest of it (what ``extra`` held when it was saved)."""
        part, views = self.part, [self.logical(o) for o in optimizers]
        checkpoint = rank_state.read(part, path, views, strict)
        rank_state.load_model(part, checkpoint, strict)
        if optimizers:
            rank_state.load_optimizers(part, checkpoint, views)
        for key in ("state_dict", "optimizer_states", rank_state.FROM_DIRECTORY):
            checkpoint.pop(key, None)
        return checkpoint

    def close(self) -> None:
        """Remove the hooks this runtime installed (BatchNorm deferral, ZeRO-1's waits for the
        parameters' gathers, after waiting for those in flight)."""
        self.gradients.close()
        if self.batch_norm is not None:
            self.batch_norm.remove()
            self.batch_norm = None

    # ------------------------------------------------------------------ construction helpers
    def _take_over_late_checkpointing(self) -> None:
        """The model's own gradient checkpointing, turned on after setup (in a hook before the first
        training batch): taken over as at setup, and said, since the layout log is already out."""
        late = take_over_checkpointing(self.module.named_modules())
        if late is None:
            return
        if any(isinstance(m, RegionDropout) for layer in self.layers for m in layer.modules()):
            raise ConfigurationError(
                "The model's gradient checkpointing was turned on after setup, which pipe_tp honours "
                'as recompute="always", but recomputation cannot replay the per-rank random stream of '
                'tensor-parallel "dropout" layers: call gradient_checkpointing_disable(), or drop the '
                '"dropout" entries of the plan.'
            )
        taken = late.merged(self.model_checkpointing)
        self.model_checkpointing = self.preparation.model_checkpointing = taken
        self.executor.recompute = taken.mode(self.executor.recompute)
        self._warn(
            f"pipe_tp: the model's gradient checkpointing was turned on after setup; recompute "
            f"{self.executor.recompute.value}{taken.describe(self._asked_recompute)}"
        )

    def _warn(self, text: str) -> None:
        """A once-per-run warning, shown by global rank 0 for the job."""
        if self.mesh.rank == 0:
            warnings.warn(text, UserWarning, stacklevel=3)

    def _layer_times(self, layers: Sequence[nn.Module], sample: Any) -> list[float] | None:
        """Every layer's forward + backward seconds per micro-batch, measured by global rank 0 and
        sent to every rank (``partition="time"``; ``None`` for other partitions)."""
        if not measures_time(self.options.partition):
            return None
        if sample is None:
            raise ConfigurationError(
                'partition="time" times each layer on a sample micro-batch, and none was given: pass '
                "`sample=` (one micro-batch's pipeline input) to ParallelRuntime, or, under Lightning, set "
                "`self.example_input_array` in the LightningModule to a batch of forward's input."
            )
        # Global rank 0 measures alone while the others wait: ranks sharing cores (or a host)
        # would skew each other's timings, and everyone must compute the same split anyway.
        totals = torch.zeros(len(layers), dtype=torch.float64, device=self.device)
        if self.mesh.rank == 0:
            totals = torch.tensor(
                [t.total for t in profile_layers(layers, sample, self.device)],
                dtype=torch.float64,
                device=self.device,
            )
        with self.naming("sending the measured layer times from global rank 0"):
            c = self.mesh.coordinates
            if c.dp_rank == 0:  # rank 0's replica first, then each replica from its dp_rank 0 twin
                dist.broadcast(totals, src=0, group=self.mesh.model_group)
            if self.mesh.layout.data_parallel_size > 1:
                src = self.mesh.layout.rank_of(0, c.pp_rank, c.tp_rank)
                dist.broadcast(totals, src=src, group=self.mesh.group(MeshAxis.DATA))
        return totals.tolist()

    def _agreed_seed(self, seed: int | None) -> int:
        """Global rank 0's seed (given, or its ``torch.initial_seed()``), on every rank: ranks
        whose environments differ (a seed set on some ranks only, or per rank) still build one model."""
        mine = seed if seed is not None else torch.initial_seed()
        value = torch.tensor([mine % 2**62], dtype=torch.int64, device=self.device)
        with self.naming("agreeing on the seed of the initial weights"):
            dist.broadcast(value, src=0)
        return int(value)

    def _tied_groups(self, partition: PipelinePartition) -> list[tuple[str, dist.ProcessGroup, bool]]:
        """For each tied parameter this rank holds: its name, the group of its copies' ranks, and
        whether this rank counts it in the gradient norm (the first stage does)."""
        layout, held = self.mesh.layout, self.stage_indices
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # new_group is collective: every rank creates every group, in the same order.
        for stages in sorted({stages for _, stages in partition.tied}):
            # The ranks holding those stages (one rank may hold several of them).
            pp_ranks = sorted({partition.rank_of_stage(s, layout.pipeline_parallel_size) for s in stages})
            for dp in range(layout.data_parallel_size):
                for tp in range(layout.tensor_parallel_size):
                    ranks = [layout.rank_of(dp, r, tp) for r in pp_ranks]
                    group = dist.new_group(ranks)
                    if self.mesh.rank in ranks:
                        groups[stages] = group
        return [
            (name, groups[stages], stages[0] in held)
            for name, stages in partition.tied
            if any(s in held for s in stages)
        ]


def _indivisible_sequence(probe: Any, tp: int) -> str | None:
    """Under sequence parallelism, the problem with a first-layer input whose sequence (dim 1 of
    its first tensor of two or more dims) the tensor ranks cannot split evenly, if so."""
    tensors = probe if isinstance(probe, tuple) else (probe,)
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is None or first.shape[1] % tp == 0:
        return None
    return (
        f"sequence_parallel=True splits the sequence over the {tp} tensor ranks, but this batch's sequence "
        f"length is {first.shape[1]}, which {tp} does not divide. Pad the sequences to a multiple of {tp} "
        f"(e.g. pad_to_multiple_of={tp} in the collator), or set sequence_parallel=False."
    )


def _parameters_named(module: nn.Module, name: str) -> list[nn.Parameter]:
    """The unsliced parameters of the submodule ``name`` (a tensor-parallel slice's gradient is
    its own, never summed), or the parameter ``name`` itself."""
    try:
        sub = module.get_submodule(name)
    except AttributeError:
        return [module.get_parameter(name)]
    return [p for p in sub.parameters() if tensor_parallel_dim(p) is None]
