"""Split, shard and materialise a model for a layout, once per model.

The first :class:`~lightning_pipe.runtime.ParallelRuntime` built over a module splits its pipeline
layers into stages, makes the copies of tied parameters and the tensor group's full weights equal
(so that a run without a seed still trains one model), shards this stage's modules over the tensor
group, gives a meta-built stage storage and layout-independent values, and keeps what it did
*on the module itself* (a :class:`Preparation`). Every later runtime over that module (validate or
predict after fit, another fit, a new Trainer) finds it and reuses the split and sliced model
instead of partitioning again (that would count sliced parameters, and slicing a sliced module is
an error); a later one with another layout is refused, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.construction.materialize import InitFn, materialize, release
from lightning_pipe.construction.meta import has_meta_tensors
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.experts.apply import ExpertSharding
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.experts import split_experts
from lightning_pipe.runtime.holdings import Holdings, gather_holdings
from lightning_pipe.runtime.model_recompute import ModelCheckpointing
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.skip.plan import SkipLayers
from lightning_pipe.tensor_parallel.plan import lora_region_dropouts, resolve_plan
from lightning_pipe.tensor_parallel.stage import count_slicing, slice_stage

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle

_PREPARED = "_lightning_pipe_prepared"
_SHOWN = 5  # unused keys named in the warning before "and N more"
log = logging.getLogger(__name__)


@dataclass
class Preparation:
    """How a module was split (and sharded) for a layout; kept in the module's ``__dict__``."""

    layout: ParallelLayout
    method: Any
    """The ``partition`` option that split it (a method's name or layer counts)."""
    partition: PipelinePartition
    virtual_stages: int = 1
    slicing: str = ""
    """What every stage slices over the tensor group, for the start-of-run log."""
    tied_paths: dict[str, str] = field(default_factory=dict)
    """For each tied parameter this rank holds, a name of it inside this rank's layers: after
    tensor-parallel sharding, that name leads to this stage's slice (the parameter's first name
    may lead into another stage's layer, which this rank does not shard)."""
    holdings: Holdings | None = None
    """What each stage holds (whole and per rank), for the layout log and the model summary."""
    built_on_meta: bool = False
    summed_over_tensor: tuple[str, ...] = ()
    """Modules kept whole on every tensor rank whose gradients are summed over the tensor group
    (the plan's ``replicated_sum`` entries: each rank's gradient covers its own heads only)."""
    seed: int = 0
    """The seed every rank agreed on at setup (initial values, tensor-parallel dropout streams,
    layer-seeded dropout)."""
    fully_sharded: FullyShardedStages | None = None
    """This rank's stages under FSDP2 (``shard_parameters``), once a runtime has sharded them:
    sharding is not undone, so later runtimes reuse it."""
    model_checkpointing: ModelCheckpointing | None = None
    """The model's own gradient checkpointing, taken over by the first runtime (later runtimes
    recompute as it did)."""
    experts: ExpertSharding | None = None
    """With ``expert_parallel_size > 1``: the experts modules this rank's stages cut to its block
    of experts (:mod:`lightning_pipe.experts.apply`)."""
    skips: SkipLayers | None = None
    """The pipeline layers' skip connections (their declarations and :class:`Stash` / :class:`Pop`
    wrappers), read from the layers of the first setup, which later setups are not given."""
    mesh: MeshHandle = field(default_factory=lambda: MeshHandle(None))
    """The mesh the module was prepared on: its tensor slices, shards and tied copies use that
    mesh's groups, so a later Trainer call with the same layout runs on it (:func:`prepared_mesh`)
    rather than on a new set of groups."""


def preparation_of(
    module: nn.Module, layout: ParallelLayout, method: Any, virtual_stages: int = 1
) -> Preparation | None:
    """How ``module`` was prepared earlier, if it was; an error if that was for another layout."""
    done: Preparation | None = module.__dict__.get(_PREPARED)
    if done is not None and (
        done.layout != layout or done.method != method or done.virtual_stages != virtual_stages
    ):
        split = "" if done.virtual_stages == 1 else f" and {done.virtual_stages} stages per rank"
        asked = "" if virtual_stages == 1 else f" and {virtual_stages} stages per rank"
        raise ConfigurationError(
            f"{type(module).__name__} was already split for the pipe_tp layout {done.layout} with "
            f"partition={done.method!r}{split} by an earlier Trainer call; this call asks for "
            f"{layout} with partition={method!r}{asked}. Each rank now holds (and has trained) only its "
            "own stage and tensor slice, so the model cannot be split again. To change the layout, save a "
            "checkpoint (trainer.save_checkpoint) and load it into a freshly built model under the new "
            "layout (trainer.fit/validate(new_model, ckpt_path=...))."
        )
    return done


class MeshHandle:
    """A :class:`Preparation`'s mesh, kept out of copies of the module: process groups cannot be
    pickled, and ``copy.deepcopy(model)`` after setup (Lightning's ``StochasticWeightAveraging``,
    an EMA or teacher copy) or ``torch.save(model)`` must still work. A deep copy shares the mesh
    (the groups are the process's); a pickle drops it."""

    __slots__ = ("mesh",)

    def __init__(self, mesh: ParallelMesh | None) -> None:
        self.mesh = mesh

    def __deepcopy__(self, memo: dict[int, Any]) -> MeshHandle:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (MeshHandle, (None,))


def prepared_mesh(module: nn.Module, layout: ParallelLayout) -> ParallelMesh | None:
    """The mesh ``module`` was prepared on, when it was prepared for ``layout`` and that mesh's
    groups still exist: the one to run a later Trainer call on (its slices and shards use it)."""
    done: Preparation | None = module.__dict__.get(_PREPARED)
    mesh = done.mesh.mesh if done is not None else None
    if mesh is None or mesh.layout != layout or not mesh.is_live():
        return None
    return mesh


@dataclass
class Preparer:
    """The first preparation of one module on this rank (see the module docstring)."""

    module: nn.Module
    mesh: ParallelMesh
    device: torch.device
    options: RuntimeOptions
    seed: int
    init: InitFn | None
    weights: WeightFiles | None
    naming: CollectiveNaming
    tied: list[tuple[str, dist.ProcessGroup, bool]]

    stages: tuple[int, ...]
    """The stages this rank holds (``PipelinePartition.stages_of_rank``)."""
    splits_sequence: bool = False
    """The layer calls split the sequence (``ModelHooks.splits_sequence``): the plan needs no
    ``sequence_scatter`` entry."""
    recompute_from_model: bool = False
    """``options.recompute`` was set by the model's own gradient checkpointing (taken over), not
    chosen: a refusal names ``gradient_checkpointing_disable()``, not ``recompute=``."""
    warnings: list[str] = field(default_factory=list)
    """Once-per-run warnings found while preparing (keys of the pretrained files nothing reads)."""

    def run(
        self, partition: PipelinePartition, layers: Sequence[nn.Module]
    ) -> tuple[Preparation, frozenset[int]]:
        """Equalise tied copies, shard, materialise by ``partition``; returns what was done and the
        ``id()`` of every tensor materialised here (equal on every replica by construction)."""
        mesh, module = self.mesh, self.module
        done = Preparation(
            mesh.layout,
            self.options.partition,
            partition,
            self.options.virtual_stages,
            seed=self.seed,
            mesh=MeshHandle(mesh),
        )
        self._equalise_tied(done)
        on_meta = has_meta_tensors(module)
        if self.weights is not None and not on_meta:
            raise ConfigurationError(
                f"pretrained={self.weights.path!r} initialises a model whose parameters are on the meta "
                f"device, but {type(module).__name__} was built with its values (in __init__). Build "
                "its layers in configure_model() (or under trainer.init_module(empty_init=True)), or "
                "load the weights yourself in __init__."
            )
        if mesh.layout.tensor_parallel_size > 1:
            done.slicing, done.summed_over_tensor = self._slice_tensor_parallel(partition, layers)
        layers = [module.get_submodule(name) for name in partition.layer_names]  # sharded, if any
        if mesh.layout.expert_parallel_size > 1:  # before materialising: only the block gets storage
            own = [layers[i] for s in self.stages for i in partition.layer_range(s)]
            done.experts = split_experts(module, mesh, self.options, own, self.naming)
        materialized: frozenset[int] = frozenset()
        if on_meta:
            materialized = self._materialize(partition, layers)
            done.built_on_meta = True
        if self.weights is not None:
            self._warn_unused(self.weights)
        with self.naming("gathering what each stage holds"):
            tp, pipeline = mesh.layout.tensor_parallel_size, mesh.group(MeshAxis.PIPELINE)
            done.holdings = gather_holdings(module, partition, self.stages, tp, pipeline)
        module.__dict__[_PREPARED] = done
        return done, materialized

    def _equalise_tied(self, done: Preparation) -> None:
        """Without a seed every rank built different weights: make the copies of each tied
        parameter equal to its first stage's before anything trains them (a meta-built one gets
        the same value on every stage when materialised)."""
        module, mesh, partition = self.module, self.mesh, done.partition
        first_stage = {name: stages[0] for name, stages in partition.tied}
        c = mesh.coordinates
        with self.naming("making the copies of tied parameters equal"):
            for name, group, _ in self.tied:
                param = module.get_parameter(name)
                if not param.is_meta:
                    holder = partition.rank_of_stage(first_stage[name], mesh.layout.pipeline_parallel_size)
                    src = mesh.layout.rank_of(c.dp_rank, holder, c.tp_rank)
                    broadcast_parameters([param], group, src)
        canonical = {id(module.get_parameter(name)): name for name, _, _ in self.tied}
        for path, param in module.named_parameters(remove_duplicate=False):
            tied_name = canonical.get(id(param))
            if tied_name is not None and partition.stage_of_key(path) in self.stages:
                done.tied_paths.setdefault(tied_name, path)

    def _materialize(self, partition: PipelinePartition, layers: Sequence[nn.Module]) -> frozenset[int]:
        """Give this rank's stage (and the module's tensors outside every layer) storage on its
        device and layout-independent initial values; other stages' tensors stay meta, and their
        buffers (built for real) are released."""
        others = other_stages_tensors(partition, layers, self.stages)
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

    def _slice_tensor_parallel(
        self, partition: PipelinePartition, layers: Sequence[nn.Module]
    ) -> tuple[str, tuple[str, ...]]:
        """Replace the tensor-parallel plan's modules inside this stage's ``layers`` (the unsliced
        pipeline layers) with sliced ones; returns what every stage slices, for the start-of-run
        log, and the modules whose gradients are summed over the tensor group."""
        tp = self.mesh.layout.tensor_parallel_size
        tp_plan = self.options.tensor_parallel_plan
        if not tp_plan:
            raise ConfigurationError(
                f"tensor_parallel_size={tp} needs a tensor-parallel plan: define "
                "`def tensor_parallel_plan(self) -> dict[str, str]` on the LightningModule (e.g. "
                '{"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}) or pass '
                "PipeTPStrategy(tensor_parallel_plan=...)."
            )
        sequence = self.options.sequence_parallel
        resolved = resolve_plan(
            self.module, tp_plan, tp, sequence_parallel=sequence, split_elsewhere=self.splits_sequence
        )
        recompute = self.options.recompute_mode
        if self.recompute_from_model:  # the user chose nothing: recompute="never" would not help
            who = (
                "The model's own gradient checkpointing (gradient_checkpointing_enable(), which pipe_tp "
                'honours as recompute="always")'
            )
            undo = "call gradient_checkpointing_disable()"
        else:
            who, undo = f'recompute="{recompute.value}"', 'use recompute="never"'
        if recompute is not RecomputeMode.NEVER and TensorParallelStyle.DROPOUT in resolved.values():
            raise ConfigurationError(
                f"{who} cannot replay the per-rank random stream of tensor-parallel "
                f'"dropout" layers; {undo} or drop the "dropout" entries.'
            )
        drawing = lora_region_dropouts(self.module, resolved)
        if recompute is not RecomputeMode.NEVER and drawing:
            raise ConfigurationError(
                f"{who} cannot replay the per-rank random stream that the LoRA "
                f"dropout {drawing[0]!r} draws from on a row-parallel layer (it sees this tensor rank's "
                f"slice of the features); {undo}, or lora_dropout=0 in the LoraConfig."
            )
        stage_of_layer = [partition.stage_of_layer(i) for i in range(len(layers))]
        counts = count_slicing(self.module, resolved, layers, stage_of_layer, partition.num_stages)
        own = [layers[i] for s in self.stages for i in partition.layer_range(s)]
        c = self.mesh.coordinates
        with self.naming("making the full weights equal across the tensor group before sharding"):
            slice_stage(
                self.module,
                resolved,
                own,
                self.mesh.group(MeshAxis.TENSOR),
                src=self.mesh.layout.rank_of(c.dp_rank, c.pp_rank, 0),
                seed=self.seed,
                sequence_parallel=sequence,
            )
        summed = tuple(
            n
            for n, style in resolved.items()
            if style in (TensorParallelStyle.REPLICATED_SUM, TensorParallelStyle.SEQUENCE)
        )
        if sequence:  # a row-parallel bias is added to each rank's part of the sequence only
            rows = (TensorParallelStyle.ROWWISE, TensorParallelStyle.ROWWISE_SPLIT)
            summed += tuple(
                f"{n}.bias"
                for n, style in resolved.items()
                if style in rows and getattr(self.module.get_submodule(n), "bias", None) is not None
            )
        text = counts.describe(tp)
        if sequence:
            text += (
                f"\n  sequence parallel: between the tensor-parallel regions each of the {tp} tensor ranks "
                "holds its part of the sequence"
            )
        if summed:
            text += f"\n  kept whole, gradients summed over the tensor group: {list(summed)}"
        return text, summed


def other_stages_tensors(
    partition: PipelinePartition, layers: Sequence[nn.Module], stages: Collection[int]
) -> set[int]:
    """``id()`` of the tensors that only other stages' layers hold (a tied parameter one of
    ``stages`` also holds is not among them)."""
    own = {i for s in stages for i in partition.layer_range(s)}

    def tensors(indices: set[int]) -> set[int]:
        chosen = [layer for i, layer in enumerate(layers) if i in indices]
        return {id(t) for layer in chosen for t in (*layer.parameters(), *layer.buffers())}

    return tensors(set(range(len(layers))) - own) - tensors(own)
