"""How a runtime shards the data axis (``shard_parameters``): when FSDP2 is applied, what it
refuses, and what the layout log says.

FSDP2 is applied once per module, by the first runtime that asks for it, after the model is split,
sliced and materialised (:class:`~lightning_pipe.data_parallel.fully_sharded.FullyShardedStages`
keeps it on the module's :class:`~lightning_pipe.runtime.prepare.Preparation`); later runtimes (a
``validate`` after ``fit``) reuse it, since sharding is not undone.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torch import nn

from lightning_pipe.data_parallel.sharded_state import is_dtensor
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.experts.reduction import expert_gradient_divisor
from lightning_pipe.experts.shard import held_block
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import ParallelMesh, check_replicate_size, data_parallel_mesh
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.runtime.prepare import Preparation

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages


def refuse_parallelized(module: nn.Module) -> None:
    """A model that arrives already sharded (``fully_shard`` or ``parallelize_module`` applied in
    ``configure_model``, as Lightning's ``ModelParallelStrategy`` expects) cannot be split into
    stages: the runtime shards it itself, after the split."""
    found = [n for n, p in module.named_parameters() if is_dtensor(p)]
    # FSDP2 not imported: no module can have been sharded (checked so, the engine need not import it).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if found or (fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in module.modules())):
        raise ConfigurationError(
            f"{type(module).__name__} already holds DTensor parameters or FSDP modules "
            f"({found[:3] or 'fully_shard applied'}): fully_shard or parallelize_module was applied to it "
            "(in configure_model, as ModelParallelStrategy expects). pipe_tp splits the model into "
            "stages first and shards each stage itself: remove those calls and set "
            "PipeTPStrategy(shard_parameters=True) for FSDP2 over the data axis and a tensor_parallel_plan "
            "(or a tensor_parallel_plan() method) for tensor parallelism."
        )


def shard_parameters(
    done: Preparation,
    layers: Sequence[nn.Module],
    stage_indices: Sequence[int],
    module: nn.Module,
    mesh: ParallelMesh,
    options: RuntimeOptions,
    naming: CollectiveNaming,
) -> FullyShardedStages | None:
    """FSDP2 over the data axis for this rank's stages (``stage_indices``; ``layers``: the model's
    pipeline layers, as ``done.partition`` names them), as ``options`` ask: applied now (collective
    over the world for HSDP's mesh), reused from an earlier runtime, or ``None`` (not asked for, or
    one data-parallel rank)."""
    layout = mesh.layout
    pp, dp = layout.pipeline_parallel_size, layout.data_parallel_size
    replicate, sharded = options.data_parallel_replicate_size, done.fully_sharded
    asked = (options.shard_parameters, replicate, options.param_dtype)
    if sharded is not None:
        was = (True, sharded.replicate_size, sharded.param_dtype)
        if asked != was:
            raise ConfigurationError(
                f"{type(module).__name__} was sharded over the data axis (shard_parameters, "
                f"data_parallel_replicate_size, param_dtype = {was}; param_dtype is torch.bfloat16 under "
                f"precision='bf16-mixed') by an earlier Trainer call; this call asks for {asked}. Each rank "
                "holds only its shards now: use the same options and precision, or save a checkpoint and "
                "load it into a freshly built model under the new ones."
            )
        sharded.set_reshard_after_forward(options.resolved_reshard_after_forward(pp))
        sharded.restore_attributes()  # moving the model (teardown's .cpu()) may have dropped them
        return sharded
    if not options.shard_parameters:
        return None
    try:
        check_replicate_size(replicate, dp)
    except ValueError as err:
        raise ConfigurationError(str(err)) from None
    if dp == 1:
        return None
    partition = done.partition
    # Every rank checks every pipeline rank's stages: all stop together, none waits in a collective.
    for pp_rank in range(pp):
        held = partition.stages_of_rank(pp_rank, pp)
        _refuse_shared_between_stages(
            {s: [layers[i] for i in partition.layer_range(s)] for s in held}, module, pp_rank
        )
    stages = {s: [layers[i] for i in partition.layer_range(s)] for s in stage_indices}
    data_mesh = data_parallel_mesh(mesh, replicate)  # collective when replicate > 1
    # Blocks of experts: over the ranks holding the same experts (mesh.py), divided by the data axis.
    expert_mesh = mesh.expert_mesh["expert_data"] if mesh.expert_mesh is not None else None
    from lightning_pipe.data_parallel.fully_sharded import ExpertShardingError, FullyShardedStages

    with naming("sharding the parameters over the data-parallel group (FSDP2)"):
        try:
            sharded = FullyShardedStages(
                stages,
                data_mesh,
                apply_layers,
                reshard_after_forward=options.resolved_reshard_after_forward(pp),
                param_dtype=options.param_dtype,
                expert_mesh=expert_mesh,
                expert_divide_factor=expert_gradient_divisor(dp),
                is_expert=lambda p: held_block(p) is not None,
            )
        except ExpertShardingError as err:
            raise ConfigurationError(str(err)) from None
    done.fully_sharded = sharded
    return sharded


def _refuse_shared_between_stages(
    stages: Mapping[int, Sequence[nn.Module]], module: nn.Module, pp_rank: int
) -> None:
    """Each stage is one FSDP root, and a parameter cannot be in two (interleaved stages of one
    rank that share a weight)."""
    names = {id(p): n for n, p in module.named_parameters()}
    held_by: dict[int, int] = {}
    for s, layers in stages.items():
        for p in {id(p): p for layer in layers for p in layer.parameters()}.values():
            if held_by.setdefault(id(p), s) != s:
                raise ConfigurationError(
                    f"The parameter {names.get(id(p), '?')!r} is used by stages {held_by[id(p)]} and {s}, "
                    f"which pipeline rank {pp_rank} both holds; shard_parameters=True shards each stage "
                    "as one FSDP root, and a parameter cannot be in two. Use another partition (or "
                    "pipeline_parallel_size / virtual_stages) that puts the two uses on different ranks "
                    "or in one stage, or shard_parameters=False."
                )


def describe_sharding(options: RuntimeOptions, dp: int, sharded: FullyShardedStages | None) -> str:
    """The layout log's line on the data axis's sharding (ZeRO-1 or FSDP2), if any."""
    if options.shard_optimizer_state:
        e = options.expert_parallel_size
        experts = f", the experts' over the {dp // e} holding the same experts" if e > 1 else ""
        return (
            f"\n  optimizer state sharded over the {dp} data-parallel replicas{experts} (ZeRO-1)"
            if dp > 1
            else "\n  shard_optimizer_state=True has no effect: one data-parallel replica holds all state"
        )
    if not options.shard_parameters:
        return ""
    if sharded is None:
        return "\n  shard_parameters=True has no effect: one data-parallel rank holds all parameters"
    replicate = sharded.replicate_size
    over = (
        f"{dp // replicate} shards within each of {replicate} replicas (HSDP)"
        if replicate > 1
        else f"the {dp} data-parallel ranks"
    )
    when = (
        "each layer gathered for its forward and again for its backward, gradients reduce-scattered at "
        "every backward"
        if sharded.reshard_after_forward
        else "each stage gathered once per step, gradients reduce-scattered once per optimizer step"
    )
    dtype = f", gathered in {str(options.param_dtype).removeprefix('torch.')}" if options.param_dtype else ""
    experts = (
        f"; the {sharded.expert_units} modules holding blocks of experts over the ranks holding the same "
        "experts (one unit each)"
        if sharded.expert_units
        else ""
    )
    return (
        f"\n  parameters, gradients and optimizer state sharded over {over} (FSDP2, one unit per "
        f"pipeline layer): {when}{dtype}{experts}"
    )
