"""Expert parallelism in a runtime: the experts cut at preparation, the replicas made equal.

With ``expert_parallel_size = E > 1`` (the mesh's expert axis, :mod:`lightning_pipe.mesh`) the
first preparation cuts the experts modules of this rank's stages to its block of experts
(:mod:`lightning_pipe.experts.apply`) before anything is materialised; replicas of a block are the
ranks holding the same experts (the expert-data group), so they are made equal over that group,
the rest over the whole data axis. :class:`~lightning_pipe.runtime.gradients.Gradients` reduces
the marked parameters over the expert-data group and counts each expert once in the norm.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.experts.apply import ExpertPlanError, ExpertSharding, expert_modules, shard_experts
from lightning_pipe.experts.shard import expert_shard
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions


def split_experts(
    module: nn.Module,
    mesh: ParallelMesh,
    options: RuntimeOptions,
    own: Sequence[nn.Module],
    naming: CollectiveNaming,
) -> ExpertSharding:
    """Cut the experts modules inside ``own`` (this rank's pipeline layers) to this rank's block
    of experts; the expert group's ranks first take the full experts of its first rank, so every
    block comes from one model whatever each rank built (a meta-built module has no values yet:
    its block is initialised from the full module when materialised)."""
    e = mesh.layout.expert_parallel_size
    plan = options.expert_parallel_plan
    if not plan:
        raise ConfigurationError(
            f"expert_parallel_size={e} needs an expert-parallel plan naming the model's experts "
            "modules ('ep_dispatch_experts') and their stacked weights ('grouped_gemm'): a Hugging "
            "Face mixture-of-experts model derives it from its config.base_model_ep_plan; else pass "
            "expert_parallel_plan=..., or use expert_parallel_size=1."
        )
    try:
        names = expert_modules(module, plan)
        if not names:
            raise ExpertPlanError(
                f"expert_parallel_size={e}, but {type(module).__name__} has no mixture-of-experts layer "
                f"(its expert-parallel plan {sorted(plan)} matches no module). Use "
                "expert_parallel_size=1 for a dense model."
            )
        group = mesh.expert_group
        assert group is not None  # an expert axis exists: E > 1
        inside = {id(m) for layer in own for m in layer.modules()}
        full = [
            p
            for name in names
            if id(module.get_submodule(name)) in inside
            for p in module.get_submodule(name).parameters(recurse=False)
            if not p.is_meta and expert_shard(p) is None
        ]
        if full:
            first = mesh.layout.expert_ranks(mesh.rank)[0]
            with naming("making the full experts equal across the expert group before splitting"):
                broadcast_parameters(full, group, first)
        return shard_experts(module, plan, own, group, e, mesh.layout.ep_rank(mesh.rank))
    except ExpertPlanError as err:
        raise ConfigurationError(str(err)) from None


def make_replicas_equal(
    own: Sequence[nn.Module], mesh: ParallelMesh, materialized: frozenset[int], naming: CollectiveNaming
) -> None:
    """Every replica takes the first replica's parameters and buffers of this rank's layers; an
    expert block, from the first expert group's rank holding the same experts (blocks differ
    across an expert group)."""
    c = mesh.coordinates
    # Materialised tensors are equal on every replica by construction: not sent again.
    # (Sharded parameters are not sent at all: each data-parallel rank holds its own shard.)
    tensors = [
        t for layer in own for t in (*layer.parameters(), *layer.buffers()) if id(t) not in materialized
    ]
    experts = [t for t in tensors if isinstance(t, nn.Parameter) and expert_shard(t) is not None]
    blocks = {id(t) for t in experts}
    with naming("making the replicas' weights equal"):
        src = mesh.layout.rank_of(0, c.pp_rank, c.tp_rank)
        broadcast_parameters([t for t in tensors if id(t) not in blocks], mesh.group(MeshAxis.DATA), src)
        if experts:
            first = mesh.layout.rank_of(mesh.layout.ep_rank(mesh.rank), c.pp_rank, c.tp_rank)
            broadcast_parameters(experts, mesh.expert_data_group, first)
