"""Split, shard and materialise a model for a layout, once per model.

The first :class:`~lightning_pipe.runtime.ParallelRuntime` built over a module splits its pipeline
layers into stages, makes the copies of tied parameters and the tensor group's full weights equal
(so that a run without a seed still trains one model), shards this stage's modules over the tensor
group, gives a meta-built stage storage and layout-independent values, and records what it did
*on the module itself*. Every later runtime over that module (validate or predict after fit,
another fit, a new Trainer) finds the record and reuses the split and sharded model instead of
planning again (planning would count sharded parameters, and sharding a sharded module is an
error); a later one with another layout is refused, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.construction.materialize import InitFn, materialize, release
from lightning_pipe.construction.meta import has_meta_tensors
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh
from lightning_pipe.pipeline.executor import CheckpointMode
from lightning_pipe.pipeline.plan import PipelinePlan
from lightning_pipe.runtime.holdings import Holdings, gather_holdings
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.tensor_parallel.plan import ShardStyle, resolve_plan
from lightning_pipe.tensor_parallel.stage import count_sharding, shard_stage

Naming = Callable[..., AbstractContextManager[None]]
"""``naming(what, peers=())``: a context that names this rank and ``what`` in a collective's error."""

_RECORD = "_lightning_pipe_prepared"
_SHOWN = 5  # unused keys named in the warning before "and N more"
log = logging.getLogger(__name__)


@dataclass
class PreparedModel:
    """How a module was split (and sharded) for a layout; kept in the module's ``__dict__``."""

    layout: ParallelLayout
    partition: Any
    plan: PipelinePlan
    virtual_stages: int = 1
    sharding: str = ""
    """What every stage shards, for the start-of-run log."""
    tied_paths: dict[str, str] = field(default_factory=dict)
    """For each tied parameter this rank holds, a name of it inside this rank's layers: after
    tensor-parallel sharding, that name leads to this stage's slice (the parameter's first name
    may lead into another stage's layer, which this rank does not shard)."""
    holdings: Holdings | None = None
    """What each stage holds (whole and per rank), for the layout log and the model summary."""
    built_on_meta: bool = False


def prepared_record(
    module: nn.Module, layout: ParallelLayout, partition: Any, virtual_stages: int = 1
) -> PreparedModel | None:
    """The record of an earlier preparation of ``module``; an error if it was for another layout."""
    record: PreparedModel | None = module.__dict__.get(_RECORD)
    if record is not None and (
        record.layout != layout or record.partition != partition or record.virtual_stages != virtual_stages
    ):
        split = "" if record.virtual_stages == 1 else f" and {record.virtual_stages} stages per rank"
        asked = "" if virtual_stages == 1 else f" and {virtual_stages} stages per rank"
        raise ConfigurationError(
            f"{type(module).__name__} was already split for the pipe_tp layout {record.layout} with "
            f"partition={record.partition!r}{split} by an earlier Trainer call; this call asks for "
            f"{layout} with partition={partition!r}{asked}. Each rank now holds (and has trained) only its "
            "own stage and tensor slice, so the model cannot be split again. To change the layout, save a "
            "checkpoint (trainer.save_checkpoint) and load it into a freshly built model under the new "
            "layout (trainer.fit/validate(new_model, ckpt_path=...))."
        )
    return record


@dataclass
class Preparation:
    """The first preparation of one module on this rank (see the module docstring)."""

    module: nn.Module
    mesh: ParallelMesh
    device: torch.device
    options: RuntimeOptions
    seed: int
    init: InitFn | None
    weights: WeightFiles | None
    naming: Naming
    tied: list[tuple[str, dist.ProcessGroup, bool]]

    stages: tuple[int, ...]
    """The stages this rank holds (``PipelinePlan.stages_of_rank``)."""
    warnings: list[str] = field(default_factory=list)
    """Once-per-run warnings found while preparing (keys of the pretrained files nothing reads)."""

    def run(self, plan: PipelinePlan, layers: Sequence[nn.Module]) -> tuple[PreparedModel, frozenset[int]]:
        """Equalise tied copies, shard, materialise by ``plan``; returns the record and the
        ``id()`` of every tensor materialised here (equal on every replica by construction)."""
        mesh, module = self.mesh, self.module
        record = PreparedModel(mesh.layout, self.options.partition, plan, self.options.virtual_stages)
        self._equalise_tied(record)
        on_meta = has_meta_tensors(module)
        if self.weights is not None and not on_meta:
            raise ConfigurationError(
                f"pretrained={self.weights.path!r} initialises a model whose parameters are on the meta "
                f"device, but {type(module).__name__} was built with its values (in __init__). Build "
                "its layers in configure_model() (or under trainer.init_module(empty_init=True)), or "
                "load the weights yourself in __init__."
            )
        if mesh.layout.tensor_parallel_size > 1:
            record.sharding = self._shard_tensor_parallel(plan, layers)
        layers = [module.get_submodule(name) for name in plan.layer_names]  # sharded, if any
        materialized: frozenset[int] = frozenset()
        if on_meta:
            materialized = self._materialize(plan, layers)
            record.built_on_meta = True
        if self.weights is not None:
            self._warn_unused(self.weights)
        with self.naming("gathering what each stage holds"):
            tp, pipeline = mesh.layout.tensor_parallel_size, mesh.group(MeshAxis.PIPELINE)
            record.holdings = gather_holdings(module, plan, self.stages, tp, pipeline)
        module.__dict__[_RECORD] = record
        return record, materialized

    def _equalise_tied(self, record: PreparedModel) -> None:
        """Without a seed every rank built different weights: make the copies of each tied
        parameter equal to its first stage's before anything trains them (a meta-built one gets
        the same value on every stage when materialised)."""
        module, mesh, plan = self.module, self.mesh, record.plan
        first_stage = {name: stages[0] for name, stages in plan.tied}
        c = mesh.coordinates
        with self.naming("making the copies of tied parameters equal"):
            for name, group, _ in self.tied:
                param = module.get_parameter(name)
                if not param.is_meta:
                    holder = plan.rank_of_stage(first_stage[name], mesh.layout.pipeline_parallel_size)
                    src = mesh.layout.rank_of(c.dp_rank, holder, c.tp_rank)
                    broadcast_parameters([param], group, src)
        canonical = {id(module.get_parameter(name)): name for name, _, _ in self.tied}
        for path, param in module.named_parameters(remove_duplicate=False):
            tied_name = canonical.get(id(param))
            if tied_name is not None and plan.stage_of_key(path) in self.stages:
                record.tied_paths.setdefault(tied_name, path)

    def _materialize(self, plan: PipelinePlan, layers: Sequence[nn.Module]) -> frozenset[int]:
        """Give this rank's stage (and the module's tensors outside every layer) storage on its
        device and layout-independent initial values; other stages' tensors stay meta, and their
        buffers (built for real) are released."""
        others = other_stages_tensors(plan, layers, self.stages)
        with self.naming("initialising this stage's parameters"):
            done = materialize(self.module, self.device, self.seed, others, self.init, self.weights)
        released = release(self.module, others)
        total = sum(t.numel() for t in (*self.module.parameters(), *self.module.buffers()))
        log.info(
            f"pipe_tp: rank {self.mesh.rank} ({self.mesh.coordinates}) materialised {done.elements:,} of "
            f"the model's {total:,} parameter and buffer elements on {self.device} (released "
            f"{released:,} elements of other stages' buffers)"
        )
        return done.tensors

    def _warn_unused(self, weights: WeightFiles) -> None:
        """Keys of the pretrained files that no state-dict key of the whole model reads: ignored,
        as ``load_state_dict(strict=False)`` would, but said once (a misspelled name must show)."""
        unused = weights.unused(self.module.state_dict().keys())
        if unused:
            shown = ", ".join(repr(k) for k in unused[:_SHOWN])
            more = f" and {len(unused) - _SHOWN} more" if len(unused) > _SHOWN else ""
            self.warnings.append(
                f"pipe_tp: the pretrained weights {weights.path} hold {len(unused)} tensor"
                f"{'s' if len(unused) != 1 else ''} that no parameter or buffer of "
                f"{type(self.module).__name__} reads (pretrained_prefix={weights.prefix!r}): {shown}{more}. "
                "They are ignored. Check for a misspelled or extra name, weights of another model "
                "configuration, or a wrong pretrained_prefix."
            )

    def _shard_tensor_parallel(self, plan: PipelinePlan, layers: Sequence[nn.Module]) -> str:
        """Replace the plan's modules inside this stage's ``layers`` (the unsharded pipeline
        layers) with sharded ones; returns what every stage shards, for the start-of-run log."""
        tp = self.mesh.layout.tensor_parallel_size
        tp_plan = self.options.tensor_parallel_plan
        if not tp_plan:
            raise ConfigurationError(
                f"tensor_parallel_size={tp} needs a tensor-parallel plan: define "
                "`def tensor_parallel_plan(self) -> dict[str, str]` on the LightningModule (e.g. "
                '{"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}) or pass '
                "PipeTPStrategy(tensor_parallel_plan=...)."
            )
        resolved = resolve_plan(self.module, tp_plan, tp)
        recomputation = self.options.recomputation_mode
        if recomputation is not CheckpointMode.NEVER and ShardStyle.DROPOUT in resolved.values():
            raise ConfigurationError(
                f'checkpoint="{recomputation.value}" cannot replay the per-rank random stream of '
                'tensor-parallel "dropout" layers; use checkpoint="never" or drop the "dropout" entries.'
            )
        stage_of_layer = [plan.stage_of_layer(i) for i in range(len(layers))]
        counts = count_sharding(self.module, resolved, layers, stage_of_layer, plan.num_stages)
        own = [layers[i] for s in self.stages for i in plan.layer_range(s)]
        c = self.mesh.coordinates
        with self.naming("making the full weights equal across the tensor group before sharding"):
            shard_stage(
                self.module,
                resolved,
                own,
                self.mesh.group(MeshAxis.TENSOR),
                src=self.mesh.layout.rank_of(c.dp_rank, c.pp_rank, 0),
                seed=self.seed,
            )
        return counts.describe(tp)


def other_stages_tensors(
    plan: PipelinePlan, layers: Sequence[nn.Module], stages: Collection[int]
) -> set[int]:
    """``id()`` of the tensors that only other stages' layers hold (a tied parameter one of
    ``stages`` also holds is not among them)."""
    own = {i for s in stages for i in plan.layer_range(s)}

    def tensors(indices: set[int]) -> set[int]:
        chosen = [layer for i, layer in enumerate(layers) if i in indices]
        return {id(t) for layer in chosen for t in (*layer.parameters(), *layer.buffers())}

    return tensors(set(range(len(layers))) - own) - tensors(own)
