"""What a :class:`~lightning_pipe.runtime.ParallelRuntime` is made of, built once per runtime.

Building a runtime is a fixed sequence of steps, several of them collective (every rank must take
them in the same order, or the job hangs): take over the model's own gradient checkpointing,
partition the layers (timing them first under ``partition="time"``), create the process groups of
tied copies, agree on the seed, split, slice and materialise the model (:mod:`.prepare`, on the
module's first setup only), make the replicas' weights equal, shard the stages over the data axis
(FSDP2), compile the layers (``compile``), make the executor, the gradients and the BatchNorm
deferral. :func:`build` takes those steps in that order and returns their products as one
:class:`Built`, which the runtime keeps; each step is a function of what it needs, so the order
(and what each step depends on) reads from :func:`build` alone.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.construction.materialize import InitFn
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.execution.batchnorm import DeferredBatchNorm, batch_norm_layers, normalising_by_batch
from lightning_pipe.execution.compile import compile_layers
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.execution.layers import bind_layers
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.faults.board import FaultBoard
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh
from lightning_pipe.partition.balance import measures_time
from lightning_pipe.partition.model import PipelinePartition, partition_model
from lightning_pipe.partition.profile import profile_layers
from lightning_pipe.runtime.batch import sample_microbatch
from lightning_pipe.runtime.experts import make_replicas_equal
from lightning_pipe.runtime.gradients import Gradients
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
from lightning_pipe.runtime.prepare import Preparation, Preparer, preparation_of
from lightning_pipe.runtime.sharding import refuse_parallelized, shard_parameters
from lightning_pipe.skip.plan import SkipLayers, SkipRoute
from lightning_pipe.tensor_parallel.eager import keep_eager_under_compile
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages

TiedGroup = tuple[str, dist.ProcessGroup, bool]
"""A tied parameter this rank holds: its name, the group of its copies' ranks, and whether it
counts in the gradient norm here (the first stage's copy does)."""


@dataclass
class Built:
    """What :func:`build` made; the runtime keeps each part as its attribute of the same name."""

    options: RuntimeOptions
    """The options as run: ``recompute`` honours the model's own checkpointing, if taken over."""
    asked_recompute: RecomputeMode
    """The ``recompute`` the caller asked for (before the model's checkpointing was taken over)."""
    model_checkpointing: ModelCheckpointing | None
    """The model's own gradient checkpointing that this runtime took over (turned off inside the
    stages, honoured by ``recompute``), if the model had it on."""
    first_setup: bool
    """Whether this runtime split, sliced and materialised the module (its first setup)."""
    warnings: list[str]
    """Once-per-run warnings, shown on global rank 0 (every rank has them)."""
    partition: PipelinePartition
    """Which layers each stage holds (tied weights and aliases included)."""
    stage_indices: tuple[int, ...]
    """The stages this rank holds; every stage-dependent choice reads this."""
    preparation: Preparation
    """How the module was split and sliced (kept on the module for later runtimes)."""
    layers: list[nn.Module]
    """The pipeline layers (tensor-parallel slices where sliced), as the partition names them."""
    executed: list[nn.Module]
    """The layers as the executor applies them (with the hooks' calls and skip wrappers)."""
    skip_routes: tuple[SkipRoute, ...]
    """The skip connections between stages (all of the pipeline's, not only this rank's)."""
    fully_sharded: FullyShardedStages | None
    """This rank's stages under FSDP2 (``shard_parameters`` with several data-parallel ranks)."""
    parameters: list[nn.Parameter]
    """This rank's trainable parameters (its stages' layers, tensor slices, FSDP2 shards)."""
    executor: PipelineExecutor
    """Runs this rank's part of each schedule."""
    gradients: Gradients
    """This rank's gradients from the first backward of a window to the optimizer step."""
    batch_norm: DeferredBatchNorm | None
    """The deferral of BatchNorm statistics to the whole batch (``deferred_batch_norm``), if the
    layers hold BatchNorm."""


def own_layers(
    layers: Sequence[nn.Module], partition: PipelinePartition, stages: Sequence[int]
) -> list[nn.Module]:
    """The pipeline layers of ``stages`` (the stages a rank holds), in order."""
    return [layers[i] for s in stages for i in partition.layer_range(s)]


def build(
    module: nn.Module,
    layers: Sequence[nn.Module],
    mesh: ParallelMesh,
    device: torch.device,
    options: RuntimeOptions,
    naming: CollectiveNaming,
    hooks: ModelHooks,
    *,
    seed: int | None,
    init: InitFn | None,
    weights: WeightFiles | None,
    sample: Any,
    example_input: Any,
    board: FaultBoard | None,
    trains: bool,
) -> Built:
    """Every part of a runtime over ``module`` on this rank, in the order the ranks must agree on
    (see the module docstring and :class:`~lightning_pipe.runtime.ParallelRuntime`'s arguments)."""
    layout, v = mesh.layout, options.virtual_stages
    done = preparation_of(module, layout, options.partition, v)
    first_setup = done is None
    if done is None and sample is None and example_input is not None and measures_time(options.partition):
        # partition="time": one micro-batch of forward's example input, split like a batch.
        sample = sample_microbatch(
            example_input, options.num_microbatches, layout.pipeline_parallel_size, hooks.pipeline_input
        )
    asked = options.recompute_mode
    taken = take_over_checkpointing(module.named_modules())
    if done is not None and done.model_checkpointing is not None:
        taken = done.model_checkpointing.merged(taken)
    if taken is not None:
        options = dataclasses.replace(options, recompute=taken.mode(asked))
    # The model's own layers inside any Stash / Pop wrappers (later setups keep the first's skips).
    layers, skips = SkipLayers.of(layers)
    warnings: list[str] = []
    if done is None:
        _refuse_before_partitioning(module, len(layers), skips, layout, options)
        times = layer_times(
            skips.wrap(bind_layers(layers, hooks.layer_calls)), sample, options, mesh, device, naming
        )
        partition = partition_model(
            module, layers, layout.pipeline_parallel_size * v, options.partition, times
        )
    else:
        partition = done.partition
    stage_indices = partition.stages_of_rank(mesh.coordinates.pp_rank, layout.pipeline_parallel_size)
    mixed_batch_norms = batch_norms_mixing(module, partition, options.num_microbatches)
    if mixed_batch_norms and trains and not options.allow_batch_norm_microbatches:
        # Refused before anything is split, sliced or trained.
        raise ConfigurationError(batch_norm_refused(mixed_batch_norms, options.num_microbatches))
    tied = tied_groups(partition, mesh, stage_indices)  # collective (new_group): before the seed's broadcast
    materialized: frozenset[int] = frozenset()
    if done is None:
        preparer = Preparer(
            module,
            mesh,
            device,
            options,
            agreed_seed(seed, device, naming),
            init,
            weights,
            naming,
            tied,
            stage_indices,
            splits_sequence=hooks.splits_sequence,
            recompute_from_model=taken is not None and asked is RecomputeMode.NEVER,
        )
        done, materialized = preparer.run(partition, layers)
        done.skips = skips
        warnings += preparer.warnings
    done.model_checkpointing = taken
    skips = done.skips or skips
    model_layers = [module.get_submodule(name) for name in partition.layer_names]
    executed = skips.wrap(bind_layers(model_layers, hooks.layer_calls if model_layers else None))
    own = own_layers(model_layers, partition, stage_indices)
    if layout.data_parallel_size > 1 and done.fully_sharded is None:
        make_replicas_equal(own, mesh, materialized, naming)
    fully_sharded = shard_parameters(done, model_layers, stage_indices, module, mesh, options, naming)
    compiling = options.compile_arguments is not None or "torch._dynamo" in sys.modules
    if layout.tensor_parallel_size > 1 and compiling:
        # Compiled layers (ours, or a user's: compiling imported Dynamo) run the sharded layers
        # eagerly between their graphs; a process that never compiles does not import Dynamo.
        keep_eager_under_compile()
    compile_layers(own, options.compile_arguments, layout.tensor_parallel_size)  # after slicing, sharding
    staged: dict[int, Sequence[nn.Module]] = {
        s: [executed[i] for i in partition.layer_range(s)] for s in stage_indices
    }
    if fully_sharded is not None:
        # The executor runs each stage's FSDP root, which applies the layers.
        fully_sharded.bind(staged)
        staged = {s: [fully_sharded.roots[s]] for s in stage_indices}
    owned = {id(p): p for layer in own for p in layer.parameters() if p.requires_grad}
    parameters = list(owned.values())
    skip_routes = skips.plan.routes(partition.stage_of_layer)
    executor = PipelineExecutor(
        staged,
        partition.num_stages,
        mesh.pipeline_peers,
        device,
        options.recompute,
        timeout=options.timeout,
        check_finite=options.check_finite,
        board=board,
        skips=skip_routes,
        skip_declarations={s: skips.plan.declared_by(partition.layer_range(s)) for s in stage_indices},
    )
    gradients = Gradients(
        parameters,
        [
            (module.get_parameter(done.tied_paths.get(name, name)), group, counts)
            for name, group, counts in tied
        ],
        mesh,
        naming,
        options.bucket_cap_mb,
        shard=options.shard_optimizer_state,
        fully_sharded=fully_sharded,
        overlap_param_gather=options.overlap_param_gather,
        summed_over_tensor=[
            p for name in done.summed_over_tensor for p in _parameters_named(module, name) if id(p) in owned
        ],
    )
    if first_setup:
        warnings += options_without_effect(options, layout)
    batch_norm = None
    if mixed_batch_norms and options.allow_batch_norm_microbatches:
        warnings.append(batch_norm_mixes(mixed_batch_norms))
    if batch_norm_layers(model_layers):
        if options.deferred_batch_norm:
            batch_norm = DeferredBatchNorm(batch_norm_layers(own))
        else:
            warnings.append(BATCH_NORM_NOT_DEFERRED)
    return Built(
        options=options,
        asked_recompute=asked,
        model_checkpointing=taken,
        first_setup=first_setup,
        warnings=warnings,
        partition=partition,
        stage_indices=stage_indices,
        preparation=done,
        layers=model_layers,
        executed=executed,
        skip_routes=skip_routes,
        fully_sharded=fully_sharded,
        parameters=parameters,
        executor=executor,
        gradients=gradients,
        batch_norm=batch_norm,
    )


def _refuse_before_partitioning(
    module: nn.Module, num_layers: int, skips: SkipLayers, layout: ParallelLayout, options: RuntimeOptions
) -> None:
    """On the first setup, what cannot be split at all, refused before any work."""
    v = options.virtual_stages
    if v > 1 and num_layers < layout.pipeline_parallel_size * v:
        raise ConfigurationError(
            f"The model has {num_layers} pipeline layers but interleaved 1F1B asks for "
            f"pipeline_parallel_size ({layout.pipeline_parallel_size}) x virtual_stages ({v}) = "
            f"{layout.pipeline_parallel_size * v} stages, each needing at least one layer. Lower "
            "virtual_stages or pipeline_parallel_size, or return finer-grained layers from "
            "configure_pipeline()."
        )
    refuse_parallelized(module)
    for name in ("expert_parallel_size", "context_parallel_size"):  # axes carved from the data axis
        if getattr(options, name) != getattr(layout, name):
            raise ConfigurationError(
                f"{name}={getattr(options, name)} in the options, but the mesh was laid out with "
                f"{name}={getattr(layout, name)} ({layout}); build the mesh with "
                f"ParallelLayout(..., {name}=...) equal to the option."
            )
    if not skips.plan.empty and options.sequence_parallel and layout.tensor_parallel_size > 1:
        raise ConfigurationError(
            "pipe_tp: skip connections (Stash / Pop, @skippable) cannot be combined with "
            "sequence_parallel=True yet: a stashed tensor inside a sequence-parallel region is "
            "one tensor rank's part of the sequence. Turn sequence_parallel off for this model."
        )


def options_without_effect(options: RuntimeOptions, layout: ParallelLayout) -> list[str]:
    """The warnings for options that do nothing at this layout (said on the first setup)."""
    found = []
    if options.shard_optimizer_state and layout.data_parallel_size == 1:
        found.append(SHARDING_ONE_REPLICA)
    if options.shard_parameters and layout.data_parallel_size == 1:
        found.append(PARAMETERS_ONE_REPLICA)
    if options.sequence_parallel and layout.tensor_parallel_size == 1:
        found.append(
            "pipe_tp: sequence_parallel=True has no effect with tensor_parallel_size=1 (the sequence is "
            "split over the tensor ranks, and there is one) but to turn on layer-seeded dropout; for "
            "that alone, say layer_seeded_dropout=True."
        )
    return found


def batch_norms_mixing(
    module: nn.Module, partition: PipelinePartition, num_microbatches: int | None
) -> list[str]:
    """The names of the BatchNorm modules in the pipeline's layers when a batch is split into
    several micro-batches (each then normalised by its own statistics); none with one. A
    BatchNorm in eval mode (frozen statistics, as fine-tuning often keeps them; Lightning
    leaves a submodule's mode as the user set it) normalises by its running statistics: exact."""
    if num_microbatches == 1:
        return []
    layers = [module.get_submodule(name) for name in partition.layer_names]
    names = {id(m): n for n, m in module.named_modules()}
    return [names[id(m)] for m in normalising_by_batch(layers) if m.training]


def layer_times(
    layers: Sequence[nn.Module],
    sample: Any,
    options: RuntimeOptions,
    mesh: ParallelMesh,
    device: torch.device,
    naming: CollectiveNaming,
) -> list[float] | None:
    """Every layer's forward + backward seconds per micro-batch, measured by global rank 0 and
    sent to every rank (``partition="time"``; ``None`` for other partitions)."""
    if not measures_time(options.partition):
        return None
    if sample is None:
        raise ConfigurationError(
            'partition="time" times each layer on a sample micro-batch, and none was given: pass '
            "`sample=` (one micro-batch's pipeline input) to ParallelRuntime, or, under Lightning, set "
            "`self.example_input_array` in the LightningModule to a batch of forward's input."
        )
    # Global rank 0 measures alone while the others wait: ranks sharing cores (or a host)
    # would skew each other's timings, and everyone must compute the same split anyway.
    totals = torch.zeros(len(layers), dtype=torch.float64, device=device)
    if mesh.rank == 0:
        totals = torch.tensor(
            [t.total for t in profile_layers(layers, sample, device)], dtype=torch.float64, device=device
        )
    with naming("sending the measured layer times from global rank 0"):
        c = mesh.coordinates
        if c.dp_rank == 0:  # rank 0's replica first, then each replica from its dp_rank 0 twin
            dist.broadcast(totals, src=0, group=mesh.model_group)
        if mesh.layout.data_parallel_size > 1:
            src = mesh.layout.rank_of(0, c.pp_rank, c.tp_rank)
            dist.broadcast(totals, src=src, group=mesh.group(MeshAxis.DATA))
    return totals.tolist()


def agreed_seed(seed: int | None, device: torch.device, naming: CollectiveNaming) -> int:
    """Global rank 0's seed (given, or its ``torch.initial_seed()``), on every rank: ranks
    whose environments differ (a seed set on some ranks only, or per rank) still build one model."""
    mine = seed if seed is not None else torch.initial_seed()
    value = torch.tensor([mine % 2**62], dtype=torch.int64, device=device)
    with naming("agreeing on the seed of the initial weights"):
        dist.broadcast(value, src=0)
    return int(value)


def tied_groups(partition: PipelinePartition, mesh: ParallelMesh, held: Sequence[int]) -> list[TiedGroup]:
    """For each tied parameter this rank holds (in the stages ``held``): its name, the group of its
    copies' ranks, and whether this rank counts it in the gradient norm (the first stage does)."""
    layout = mesh.layout
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    # Collective: every rank asks for every group in the same order (kept by the mesh for later).
    for stages in sorted({stages for _, stages in partition.tied}):
        # The ranks holding those stages (one rank may hold several of them).
        pp_ranks = sorted({partition.rank_of_stage(s, layout.pipeline_parallel_size) for s in stages})
        copies = [
            [layout.rank_of(dp, r, tp) for r in pp_ranks]
            for dp in range(layout.data_parallel_size)
            for tp in range(layout.tensor_parallel_size)
        ]
        if (group := mesh.subgroup(copies)) is not None:
            groups[stages] = group
    return [
        (name, groups[stages], stages[0] in held)
        for name, stages in partition.tied
        if any(s in held for s in stages)
    ]


def _parameters_named(module: nn.Module, name: str) -> list[nn.Parameter]:
    """The unsliced parameters of the submodule ``name`` (a tensor-parallel slice's gradient is
    its own, never summed), or the parameter ``name`` itself."""
    try:
        sub = module.get_submodule(name)
    except AttributeError:
        return [module.get_parameter(name)]
    return [p for p in sub.parameters() if tensor_parallel_dim(p) is None]
