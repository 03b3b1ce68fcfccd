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

import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_pipe.construction.materialize import materialize, release
from lightning_pipe.construction.meta import has_meta_tensors, meta_tensors_set_aside
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.mesh import MeshAxis, ParallelLayout
from lightning_pipe.pipeline.actions import PipelineSchedule
from lightning_pipe.pipeline.batchnorm import DeferredBatchNorm, batch_norm_layers
from lightning_pipe.pipeline.executor import CheckpointMode, PipelineExecutor
from lightning_pipe.pipeline.plan import PipelinePlan, make_plan
from lightning_pipe.pipeline.schedules import ScheduleKind
from lightning_pipe.strategy.base import PipeTPParts
from lightning_pipe.strategy.summary import Holdings, gather_holdings
from lightning_pipe.tensor_parallel.plan import ShardStyle, resolve_plan
from lightning_pipe.tensor_parallel.stage import count_sharding, shard_stage

_PREPARED = "_lightning_pipe_prepared"
log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    """How the first Trainer call split (and sharded) a module; kept in the module's ``__dict__``
    so that every later call, with this strategy or a new one, reuses it instead of sharding the
    sharded model again."""

    layout: ParallelLayout
    partition: Any
    plan: PipelinePlan
    sharding: str = ""
    holdings: Holdings | None = None
    """What each stage holds (whole and per rank), for the layout log and the model summary."""
    tied_paths: dict[str, str] = field(default_factory=dict)
    """For each tied parameter this rank holds, a name of it inside this rank's layers: after
    tensor-parallel sharding, that name leads to this stage's slice (the parameter's first name
    may lead into another stage's layer, which this rank does not shard)."""


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
    pretrained: str | None
    pretrained_prefix: str
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
    _holdings: Holdings | None

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
        materialized: frozenset[int] = frozenset()
        if first_setup:
            # Without seed_everything every rank built different weights: make the copies of each
            # tied parameter equal to its first stage's before anything trains them (a meta-built
            # one gets the same value on every stage when materialised).
            first_stage = {name: stages[0] for name, stages in plan.tied}
            c = mesh.coordinates
            with self._collective("making the copies of tied parameters equal"):
                for name, group, _ in tied:
                    param = module.get_parameter(name)
                    if not param.is_meta:
                        src = mesh.layout.rank_of(c.dp_rank, first_stage[name], c.tp_rank)
                        broadcast_parameters([param], group, src)
            canonical = {id(module.get_parameter(name)): name for name, _, _ in tied}
            for path, param in module.named_parameters(remove_duplicate=False):
                tied_name = canonical.get(id(param))
                if tied_name is not None and plan.stage_of_key(path) == self.pp_rank:
                    prepared.tied_paths.setdefault(tied_name, path)
            on_meta = has_meta_tensors(module)
            if self.pretrained is not None and not on_meta:
                raise MisconfigurationException(
                    f"pretrained={self.pretrained!r} initialises a model whose parameters are on the meta "
                    f"device, but {type(module).__name__} was built with its values (in __init__). Build "
                    "its layers in configure_model() (or under trainer.init_module(empty_init=True)), or "
                    "load the weights yourself in __init__."
                )
            if mesh.layout.tensor_parallel_size > 1:
                prepared.sharding = self._shard_tensor_parallel(module, plan, layers)
        layers = module.configure_pipeline()  # type: ignore[operator]  # sharded layers, if any
        if first_setup:
            if on_meta:
                materialized = self._materialize(module, plan, layers)
            with self._collective("gathering what each stage holds"):
                prepared.holdings = gather_holdings(
                    module,
                    plan,
                    self.pp_rank,
                    mesh.layout.tensor_parallel_size,
                    mesh.group(MeshAxis.PIPELINE),
                )
            module.__dict__[_PREPARED] = prepared
        self._holdings = prepared.holdings
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
            # Materialised tensors are equal on every replica by construction: not sent again.
            tensors = [t for layer in own for t in (*layer.parameters(), *layer.buffers())]
            tensors = [t for t in tensors if id(t) not in materialized]
            broadcast_parameters(tensors, dp_group, src)
            self._reducer = GradientReducer(self._owned_params, dp_group, self.bucket_cap_mb)
        self._tied = [
            (module.get_parameter(prepared.tied_paths.get(name, name)), group, counts)
            for name, group, counts in tied
        ]
        self._setup_batch_norm(layers, own)
        self._forward_checked = False
        if first_setup:
            holdings = prepared.holdings
            per_rank = (
                holdings.per_rank if holdings is not None and mesh.layout.tensor_parallel_size > 1 else None
            )
            rank_zero_info(
                f"pipe_tp: layout {mesh.layout} (world {mesh.layout.world_size}), schedule "
                f"{self.schedule.value}, micro-batches {self.num_microbatches or f'auto (2 x {pp})'}, "
                f"checkpoint {self.checkpoint.value}\n"
                + plan.describe(layers, per_rank)
                + (f"\n{prepared.sharding}" if prepared.sharding else "")
                + (
                    "\n  built on the meta device: each rank holds only its own stage's tensors (and "
                    "tensor slice); other stages' parameters are meta tensors, without storage"
                    if materialized
                    else ""
                )
            )

    def _materialize(
        self, module: LightningModule, plan: PipelinePlan, layers: list[torch.nn.Module]
    ) -> frozenset[int]:
        """Give this rank's stage (and the module's tensors outside every layer) storage on its
        device and layout-independent initial values; other stages' tensors stay meta, and their
        buffers (built for real) are released. Returns the ``id()`` of every tensor created."""
        seed = self._initial_seed()
        others = self._other_stages_tensors(plan, layers)
        init = getattr(module, "init_module_weights", None)
        weights = WeightFiles(self.pretrained, self.pretrained_prefix) if self.pretrained else None
        with self._collective("initialising this stage's parameters"):
            done = materialize(
                module, self.root_device, seed, others, init if callable(init) else None, weights
            )
        released = release(module, others)
        total = sum(t.numel() for t in (*module.parameters(), *module.buffers()))
        c = self.mesh.coordinates
        log.info(
            f"pipe_tp: rank {self.global_rank} ({c}) materialised {done.elements:,} of the model's "
            f"{total:,} parameter and buffer elements on {self.root_device} (released {released:,} "
            "elements of other stages' buffers)"
        )
        return done.tensors

    def _initial_seed(self) -> int:
        """The seed of every module's initial values: Lightning's global seed when one was set
        (``seed_everything``), else global rank 0's, so that all ranks agree without a seed."""
        # Always rank 0's, broadcast: ranks whose environments differ (a seed set on some ranks
        # only, or a per-rank seed) still build one model, and every rank joins the broadcast.
        env = os.environ.get("PL_GLOBAL_SEED")
        mine = int(env) if env is not None else torch.initial_seed()
        seed = torch.tensor([mine % 2**62], dtype=torch.int64, device=self.root_device)
        with self._collective("agreeing on the seed of the initial weights"):
            dist.broadcast(seed, src=0)
        return int(seed)

    def _other_stages_tensors(self, plan: PipelinePlan, layers: list[torch.nn.Module]) -> set[int]:
        """``id()`` of the tensors that only other stages' layers hold (a tied parameter this
        stage also holds is not among them)."""
        own = set(plan.layer_range(self.pp_rank))

        def tensors(indices: set[int]) -> set[int]:
            chosen = [layer for i, layer in enumerate(layers) if i in indices]
            return {id(t) for layer in chosen for t in (*layer.parameters(), *layer.buffers())}

        return tensors(set(range(len(layers))) - own) - tensors(own)

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
        module = self.lightning_module
        # Other stages' tensors have nothing to move (there may be no module after a failed setup).
        with meta_tensors_set_aside(module) if module is not None else nullcontext():
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
        skip = self._other_stages_tensors(self._plan, self._layers)
        device = self.root_device
        self.model._apply(lambda t: t if id(t) in skip else t.to(device))
