"""The whole model's (and optimizer's) state on global rank 0, for single-file checkpoints.

Used with ``PipeTPStrategy(save_distributed_checkpoint=False)`` and by tests: each stage's tensor
ranks all-gather their shards into full tensors (and each expert group its experts, by global expert
index), then the first replica's tensor-rank-0 ranks send their stage's entries to rank 0 with one
``gather_object``. Rank 0 briefly holds the whole model,
which is what the sharded format avoids; the result is an ordinary Lightning checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.checkpoint.optimizer_view import local_to_whole, whole_groups
from lightning_pipe.checkpoint.state import held_experts, parameter_names, writes_key
from lightning_pipe.data_parallel.sharded_state import full
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.tensor_parallel.layers import gather_slices, tensor_parallel_dim


def unshard(
    value: Any, param: torch.Tensor | None, group: dist.ProcessGroup, experts: dist.ProcessGroup | None = None
) -> Any:
    """Collective over ``group``: the full tensor for a value shaped like a shard of ``param``;
    of a parameter holding a block of experts, collective over its expert group ``experts`` (whose
    ranks hold the blocks in global expert order) too."""
    if param is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    value = value.detach()
    dim = tensor_parallel_dim(param)
    if dim is not None:
        value = gather_slices(value, dim, group)
    held = held_experts(param)
    if held is not None:
        if experts is None or held.first_expert != dist.get_rank(experts) * held.local_experts:
            raise CheckpointError(
                f"A parameter holds experts {held.first_expert}-{held.first_expert + held.local_experts - 1} "
                f"of {held.num_experts}, which are not this rank's block of its expert group; the experts "
                "must be split in global order over the expert group (ep_rank e holds the e-th block)."
            )
        value = gather_slices(value, held.dim, experts)
    return value


def to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)({k: to_cpu(v) for k, v in value.items()})
    if isinstance(value, tuple | list):
        return type(value)(to_cpu(v) for v in value)
    return value


def _gather_to_rank0(part: dict[Any, Any], mesh: ParallelMesh, into: dict[Any, Any]) -> dict[Any, Any]:
    c = mesh.coordinates
    mine = to_cpu(part) if c.dp_rank == 0 and c.tp_rank == 0 else {}
    gathered: list[Any] = [None] * mesh.layout.world_size if mesh.rank == 0 else []
    dist.gather_object(mine, gathered if mesh.rank == 0 else None, dst=0)
    if mesh.rank != 0:
        return {}
    for piece in gathered:
        into.update(piece or {})
    return into


def gather_model_state(module: nn.Module, partition: PipelinePartition, mesh: ParallelMesh) -> dict[str, Any]:
    """Collective: the unsharded module's state dict on global rank 0 (``{}`` elsewhere)."""
    stages = partition.stages_of_rank(mesh.coordinates.pp_rank, mesh.layout.pipeline_parallel_size)
    current = module.state_dict(keep_vars=True)
    group = mesh.group(MeshAxis.TENSOR)
    # Every tensor (and expert) rank of a stage gathers the same keys in the same order.
    # A parameter sharded over the data axis (shard_parameters) is gathered whole first.
    own = {
        k: unshard(full(v), v if isinstance(v, torch.Tensor) else None, group, mesh.expert_group)
        for k, v in current.items()
        if writes_key(partition, k, stages)
    }
    return _gather_to_rank0(
        own, mesh, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in current.items()}
    )


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer, mesh: ParallelMesh, module: nn.Module
) -> dict[str, Any]:
    """Collective: ``optimizer.state_dict()`` of the whole model (one device's numbering), with
    every stage's full entries, on global rank 0."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    whole = local_to_whole(optimizer, module, parameter_names(optimizer, module))
    group = mesh.group(MeshAxis.TENSOR)
    full = {
        whole[index]: {k: unshard(v, params[index], group, mesh.expert_group) for k, v in entry.items()}
        for index, entry in sorted(state["state"].items())
    }
    merged = _gather_to_rank0(full, mesh, {})
    if mesh.rank != 0:
        return {}
    groups = whole_groups(optimizer, module, state["param_groups"])
    return {"state": dict(sorted(merged.items())), "param_groups": groups}
