"""Build this rank's part of the model for ``PipeTPStrategy``, once per model.

The first Trainer call splits the LightningModule's pipeline layers into stages, makes the copies
of tied parameters and the tensor group's full weights equal (so that a run without
``seed_everything`` still trains one model), shards this stage's modules over the tensor group,
and records what it did *on the module itself*. Every later call (validate or predict after fit,
another fit, a new Trainer) finds that record and reuses the split and sharded model instead of
planning again (planning would count sharded parameters, and sharding a sharded module is an
error); a later call with another layout is refused, naming the fix. Each call then builds its
executor, data-parallel reducer, tied-parameter groups and BatchNorm deferral for this stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.mesh import MeshAxis, ParallelLayout
from lightning_pipe.pipeline.actions import PipelineSchedule
from lightning_pipe.pipeline.batchnorm import DeferredBatchNorm, batch_norm_layers
from lightning_pipe.pipeline.executor import CheckpointMode, PipelineExecutor
from lightning_pipe.pipeline.plan import PipelinePlan, make_plan
from lightning_pipe.pipeline.schedules import ScheduleKind
from lightning_pipe.strategy.base import PipeTPParts
from lightning_pipe.tensor_parallel.plan import ShardStyle, resolve_plan
from lightning_pipe.tensor_parallel.stage import count_sharding, shard_stage

_PREPARED = "_lightning_pipe_prepared"


@dataclass
class _Prepared:
    """How the first Trainer call split (and sharded) a module; kept in the module's ``__dict__``
    so that every later call, with this strategy or a new one, reuses it instead of sharding the
    sharded model again."""

    layout: ParallelLayout
    partition: Any
    plan: PipelinePlan
    sharding: str = ""


def _prepared(module: LightningModule, layout: ParallelLayout, partition: Any) -> _Prepared | None:
    """The record of an earlier setup of ``module``; an error if it was for another layout."""
    record: _Prepared | None = module.__dict__.get(_PREPARED)
    if record is not None and (record.layout != layout or record.partition != partition):
        raise MisconfigurationException(
            f"{type(module).__name__} was already split for the pipe_tp layout {record.layout} with "
            f"partition={record.partition!r} by an earlier Trainer call; this call asks for {layout} with "
            f"partition={partition!r}. Each rank now holds (and has trained) only its own stage and "
            "tensor slice, so the model cannot be split again. To change the layout, save a checkpoint "
            "(trainer.save_checkpoint) and load it into a freshly built model under the new layout "
            "(trainer.fit/validate(new_model, ckpt_path=...))."
        )
    return record


class ModelPreparation(PipeTPParts):
    """The model-building half of ``PipeTPStrategy`` (which provides the mesh and options)."""

    partition: Any
    tensor_parallel_plan: dict[str, str] | None
    checkpoint: CheckpointMode
    schedule: ScheduleKind
    num_microbatches: int | None
    check_finite: bool
    bucket_cap_mb: float
    deferred_batch_norm: bool
    _timeout: timedelta | None
    _plan: PipelinePlan | None
    _layers: list[torch.nn.Module]
    _owned_params: list[torch.nn.Parameter]
    _executor: PipelineExecutor | None
    _reducer: GradientReducer | None
    _tied: list[tuple[torch.nn.Parameter, dist.ProcessGroup, bool]]
    _schedules: dict[tuple[int, bool], PipelineSchedule]
    _batch_norm: DeferredBatchNorm | None
    _forward_checked: bool

    def _build_pipeline(self, module: LightningModule) -> None:
        mesh = self.mesh
        pp = mesh.layout.pipeline_parallel_size
        prepared = _prepared(module, mesh.layout, self.partition)
        first_setup = prepared is None
        if prepared is None:
            layers = module.configure_pipeline()  # type: ignore[operator]
            plan = make_plan(module, layers, pp, self.partition)
            prepared = _Prepared(mesh.layout, self.partition, plan)
        else:
            # A later Trainer call (validate after fit, another fit, ...): the model is already
            # split and sharded for this layout; planning again would count sharded parameters.
            plan = prepared.plan
        tied = self._tied_groups(plan)
        if first_setup:
            # Without seed_everything every rank built different weights: make the copies of each
            # tied parameter equal to its first stage's before anything trains them.
            first_stage = {name: stages[0] for name, stages in plan.tied}
            c = mesh.coordinates
            with self._collective("making the copies of tied parameters equal"):
                for name, group, _ in tied:
                    src = mesh.layout.rank_of(c.dp_rank, first_stage[name], c.tp_rank)
                    broadcast_parameters([module.get_parameter(name)], group, src)
            if mesh.layout.tensor_parallel_size > 1:
                prepared.sharding = self._shard_tensor_parallel(module, plan, layers)
            module.__dict__[_PREPARED] = prepared
        layers = module.configure_pipeline()  # type: ignore[operator]  # sharded layers, if any
        own = [layers[i] for i in plan.layer_range(self.pp_rank)]
        self._plan, self._layers = plan, list(layers)
        owned = {id(p): p for layer in own for p in layer.parameters() if p.requires_grad}
        self._owned_params = list(owned.values())
        self._executor = PipelineExecutor(
            {self.pp_rank: own},
            pp,
            mesh.pipeline_peers,
            self.root_device,
            self.checkpoint,
            timeout=self._timeout,
            check_finite=self.check_finite,
        )
        self._schedules.clear()
        # torchmetrics sync over the data axis only: ranks of one pipeline hold the same state.
        for sub in module.modules():
            if isinstance(sub, Metric):
                sub.process_group = mesh.group(MeshAxis.DATA)
        dp_group = mesh.group(MeshAxis.DATA)
        self._reducer = None
        if mesh.layout.data_parallel_size > 1:
            src = mesh.layout.rank_of(0, self.pp_rank, mesh.coordinates.tp_rank)
            tensors = [t for layer in own for t in (*layer.parameters(), *layer.buffers())]
            broadcast_parameters(tensors, dp_group, src)
            self._reducer = GradientReducer(self._owned_params, dp_group, self.bucket_cap_mb)
        self._tied = [(module.get_parameter(name), group, counts) for name, group, counts in tied]
        self._setup_batch_norm(layers, own)
        self._forward_checked = False
        if first_setup:
            rank_zero_info(
                f"pipe_tp: layout {mesh.layout} (world {mesh.layout.world_size}), schedule "
                f"{self.schedule.value}, micro-batches {self.num_microbatches or f'auto (2 x {pp})'}, "
                f"checkpoint {self.checkpoint.value}\n{plan.describe(layers)}"
                + (f"\n{prepared.sharding}" if prepared.sharding else "")
            )

    def _setup_batch_norm(self, layers: list[torch.nn.Module], own: list[torch.nn.Module]) -> None:
        if self._batch_norm is not None:
            self._batch_norm.remove()
        self._batch_norm = None
        if not batch_norm_layers(layers):
            return
        if self.deferred_batch_norm:
            self._batch_norm = DeferredBatchNorm(batch_norm_layers(own))
            rank_zero_warn(
                "pipe_tp: the pipeline holds BatchNorm layers. Their running statistics are those of the "
                "whole batch, as on one device (deferred batch norm), but in training they normalise "
                "each micro-batch with that micro-batch's statistics, so gradients differ from one "
                "device unless num_microbatches=1. For exact equality use num_microbatches=1, or a "
                "normalisation that does not mix samples (LayerNorm, GroupNorm)."
            )
        else:
            rank_zero_warn(
                "pipe_tp: deferred_batch_norm=False: BatchNorm layers normalise with micro-batch "
                "statistics and update their running statistics once per micro-batch, unlike one device."
            )

    @override
    def teardown(self) -> None:
        if self._batch_norm is not None:
            self._batch_norm.remove()
            self._batch_norm = None
        super().teardown()

    def _shard_tensor_parallel(
        self, module: LightningModule, plan: PipelinePlan, layers: list[torch.nn.Module]
    ) -> str:
        """Replace the plan's modules inside this stage's ``layers`` (the unsharded pipeline
        layers) with sharded ones; returns what every stage shards, for the start-of-run log."""
        tp = self.mesh.layout.tensor_parallel_size
        tp_plan = self.tensor_parallel_plan
        if tp_plan is None and callable(getattr(module, "tensor_parallel_plan", None)):
            tp_plan = module.tensor_parallel_plan()  # type: ignore[operator]
        if not tp_plan:
            raise MisconfigurationException(
                f"tensor_parallel_size={tp} needs a tensor-parallel plan: define "
                "`def tensor_parallel_plan(self) -> dict[str, str]` on the LightningModule (e.g. "
                '{"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}) or pass '
                "PipeTPStrategy(tensor_parallel_plan=...)."
            )
        resolved = resolve_plan(module, tp_plan, tp)
        if self.checkpoint is not CheckpointMode.NEVER and ShardStyle.DROPOUT in resolved.values():
            raise MisconfigurationException(
                f'checkpoint="{self.checkpoint.value}" cannot replay the per-rank random stream of '
                'tensor-parallel "dropout" layers; use checkpoint="never" or drop the "dropout" entries.'
            )
        stage_of_layer = [plan.stage_of_layer(i) for i in range(len(layers))]
        counts = count_sharding(module, resolved, layers, stage_of_layer, plan.num_stages)
        own = [layers[i] for i in plan.layer_range(self.pp_rank)]
        c = self.mesh.coordinates
        with self._collective("making the full weights equal across the tensor group before sharding"):
            shard_stage(
                module,
                resolved,
                own,
                self.mesh.group(MeshAxis.TENSOR),
                src=self.mesh.layout.rank_of(c.dp_rank, c.pp_rank, 0),
                seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            )
        return counts.describe(tp)

    def _tied_groups(self, plan: PipelinePlan) -> list[tuple[str, dist.ProcessGroup, bool]]:
        """For each tied parameter this rank holds: its name, the group of its copies' ranks, and
        whether this rank counts it in the gradient norm (the first stage does)."""
        layout = self.mesh.layout
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # new_group is collective: every rank creates every group, in the same order.
        for stages in sorted({stages for _, stages in plan.tied}):
            for dp in range(layout.data_parallel_size):
                for tp in range(layout.tensor_parallel_size):
                    ranks = [layout.rank_of(dp, s, tp) for s in stages]
                    group = dist.new_group(ranks)
                    if self.global_rank in ranks:
                        groups[stages] = group
        return [
            (name, groups[stages], self.pp_rank == stages[0])
            for name, stages in plan.tied
            if self.pp_rank in stages
        ]

    @override
    def model_to_device(self) -> None:
        # Only this stage's layers (and the module's own non-layer state) go to the device: the
        # other stages' layers stay where they were built, off the accelerator.
        assert self.model is not None and self._plan is not None
        own = set(self._plan.layer_range(self.pp_rank))

        def tensors(indices: set[int]) -> set[int]:
            layers = [layer for i, layer in enumerate(self._layers) if i in indices]
            return {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}

        # A tied parameter belongs to an owned layer too: it must move.
        skip = tensors(set(range(len(self._layers))) - own) - tensors(own)
        device = self.root_device
        self.model._apply(lambda t: t if id(t) in skip else t.to(device))
