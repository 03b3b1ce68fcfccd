"""The parallel layout: data x pipeline x tensor, and the device mesh built from it.

Ranks are laid out with the data axis outermost and the tensor axis innermost,
``rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank``, so tensor-parallel peers, which
talk on every layer, are neighbours (the same node on a real cluster), pipeline neighbours come
next, and data-parallel replicas, which talk once per step, are furthest apart (Megatron-LM's
ordering, Narayanan et al., 2021).

Across nodes the rule is: **each tensor-parallel group inside one node; the pipeline, then the data
axis, across nodes.** Every launcher numbers a node's ranks contiguously (torchrun, Lightning:
``rank = node_rank x processes_per_node + local_rank``; SLURM's default block distribution), so
the tensor-innermost order keeps a group in one node exactly when ``tensor_parallel_size`` divides
the processes per node. :func:`check_tensor_groups_in_nodes` refuses other sizes before launch,
and :class:`NodePlacement` checks where the ranks really landed (``srun --distribution=cyclic``
interleaves nodes) and says it in the layout log.

**The expert axis borrows from the data axis** (Megatron-Core's and torchtitan's rule): with
``expert_parallel_size = E``, the data-parallel ranks of one ``(pp_rank, tp_rank)`` form
``data_parallel_size / E`` expert groups of ``E`` consecutive ``dp_rank`` values
(``dp_rank = expert_replica x E + ep_rank``). The ``E`` ranks of an expert group hold different
experts of every mixture-of-experts layer and exchange tokens by all-to-all on every such layer, so
they are the data ranks closest together; the ranks with the same ``ep_rank`` (one per expert
group: the *expert-data* group) hold the same experts. Parameters outside the experts are reduced
over the whole data axis, expert parameters over the expert-data group.

**The context axis borrows from the data axis too**: with ``context_parallel_size = C``, the
data-parallel ranks of one ``(pp_rank, tp_rank)`` form ``data_parallel_size / C`` context groups
of ``C`` consecutive ``dp_rank`` values (``dp_rank = context_replica x C + cp_rank``). The ``C``
ranks of a context group get the same samples, each keeps its part of every sequence
(:mod:`lightning_pipe.context`) and they pass key/value blocks around on every attention layer;
gradients are reduced once over the whole data axis (which holds the context ranks).
"""

from __future__ import annotations

import atexit
import enum
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_pipe.arguments import check_count, divisors

__all__ = [
    "MeshAxis",
    "NodePlacement",
    "ParallelLayout",
    "ParallelMesh",
    "RankCoordinates",
    "check_context_parallel_size",
    "check_expert_parallel_size",
    "check_replicate_size",
    "check_tensor_groups_in_nodes",
    "data_parallel_mesh",
    "init_mesh",
]


class MeshAxis(enum.Enum):
    """The axes of the mesh, outermost first; values are the DeviceMesh dimension names."""

    DATA = "dp"
    PIPELINE = "pp"
    TENSOR = "tp"


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits on each axis."""

    dp_rank: int
    pp_rank: int
    tp_rank: int

    def __str__(self) -> str:
        return f"dp_rank {self.dp_rank}, pp_rank {self.pp_rank}, tp_rank {self.tp_rank}"


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three axes; their product is the world size."""

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    """Ranks of the data axis that split each mixture-of-experts layer's experts between them (the
    expert axis borrows from the data axis: it divides ``data_parallel_size``, see the module)."""
    context_parallel_size: int = 1
    """Ranks of the data axis that split each sequence between them (the context axis borrows
    from the data axis: it divides ``data_parallel_size``, see the module)."""

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"):
            check_count(name, getattr(self, name))
        check_expert_parallel_size(self.expert_parallel_size, self.data_parallel_size)
        check_context_parallel_size(self.context_parallel_size, self.data_parallel_size)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pipeline_parallel_size: int | Literal["auto"] = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
    ) -> ParallelLayout:
        """Fill in the ``"auto"`` sizes and check that the sizes multiply to the world size.

        ``"auto"`` takes what the other sizes leave. When both the pipeline and the data size are
        ``"auto"``, the pipeline takes everything (``dp = 1``): a user who asked for a pipeline
        strategy with N devices gets an N-stage pipeline per tensor group.
        """
        tp = tensor_parallel_size
        check_count("tensor_parallel_size", tp)
        if pipeline_parallel_size != "auto":
            check_count("pipeline_parallel_size", pipeline_parallel_size, also="'auto'")
        if data_parallel_size != "auto":
            check_count("data_parallel_size", data_parallel_size, also="'auto'")
        if pipeline_parallel_size == "auto":
            dp_known = 1 if data_parallel_size == "auto" else data_parallel_size
            if not isinstance(dp_known, int) or dp_known < 1 or world_size % (dp_known * tp) != 0:
                raise ValueError(
                    f"data_parallel_size ({data_parallel_size}) x tensor_parallel_size ({tp}) does not "
                    f"divide the world size {world_size} (processes: devices x nodes), so no pipeline size "
                    "fits. Use sizes whose product divides the number of processes."
                )
            pipeline_parallel_size = world_size // (dp_known * tp)
        pp = pipeline_parallel_size
        if data_parallel_size == "auto":
            if world_size % (pp * tp) != 0:
                raise ValueError(
                    f"pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp}) = {pp * tp} does "
                    f"not divide the world size {world_size} (processes: devices x nodes), so no "
                    f"data-parallel size fits. Use a number of processes that is a multiple of {pp * tp}, "
                    "or change the sizes."
                )
            data_parallel_size = world_size // (pp * tp)
        layout = cls(data_parallel_size, pp, tp, expert_parallel_size, context_parallel_size)
        if layout.world_size != world_size:
            raise ValueError(
                f"data_parallel_size ({layout.data_parallel_size}) x pipeline_parallel_size ({pp}) x "
                f"tensor_parallel_size ({tp}) = {layout.world_size}, but the world size is "
                f"{world_size}. Make the product equal the number of processes (devices x nodes), "
                'or set data_parallel_size="auto" to use what remains.'
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data_parallel_size, self.pipeline_parallel_size, self.tensor_parallel_size)

    def coordinates(self, rank: int) -> RankCoordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Rank {rank} is outside a world of {self.world_size} processes.")
        rest, tp_rank = divmod(rank, self.tensor_parallel_size)
        dp_rank, pp_rank = divmod(rest, self.pipeline_parallel_size)
        return RankCoordinates(dp_rank, pp_rank, tp_rank)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pipeline_parallel_size + pp_rank) * self.tensor_parallel_size + tp_rank

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of data-parallel replica ``dp_rank`` (its pipeline and tensor ranks): a
        contiguous block, since the data axis is the outermost."""
        per_replica = self.pipeline_parallel_size * self.tensor_parallel_size
        return list(range(dp_rank * per_replica, (dp_rank + 1) * per_replica))

    def expert_ranks(self, rank: int) -> list[int]:
        """Global ranks of the expert group of ``rank``, by ``ep_rank``: the ``E`` consecutive
        ``dp_rank`` values (same ``pp_rank`` and ``tp_rank``) whose experts together make each
        mixture-of-experts layer whole."""
        c = self.coordinates(rank)
        first = c.dp_rank - c.dp_rank % self.expert_parallel_size
        return [self.rank_of(first + e, c.pp_rank, c.tp_rank) for e in range(self.expert_parallel_size)]

    def expert_data_ranks(self, rank: int) -> list[int]:
        """Global ranks holding the same experts as ``rank`` (same ``ep_rank``, ``pp_rank`` and
        ``tp_rank``, one per expert group): what expert gradients are reduced over."""
        c = self.coordinates(rank)
        e = self.expert_parallel_size
        dp_ranks = range(c.dp_rank % e, self.data_parallel_size, e)
        return [self.rank_of(d, c.pp_rank, c.tp_rank) for d in dp_ranks]

    def ep_rank(self, rank: int) -> int:
        """``rank``'s index in its expert group."""
        return self.coordinates(rank).dp_rank % self.expert_parallel_size

    def context_ranks(self, rank: int) -> list[int]:
        """Global ranks of the context group of ``rank``, by ``cp_rank``: the ``C`` consecutive
        ``dp_rank`` values (same ``pp_rank`` and ``tp_rank``) that split each sequence."""
        c = self.coordinates(rank)
        first = c.dp_rank - c.dp_rank % self.context_parallel_size
        return [self.rank_of(first + i, c.pp_rank, c.tp_rank) for i in range(self.context_parallel_size)]

    def cp_rank(self, rank: int) -> int:
        """``rank``'s index in its context group (which part of each sequence it keeps)."""
        return self.coordinates(rank).dp_rank % self.context_parallel_size

    @property
    def sample_replicas(self) -> int:
        """How many different streams of samples the data axis reads: ``data_parallel_size / C``
        (the ranks of a context group read the same samples)."""
        return self.data_parallel_size // self.context_parallel_size

    def tensor_ranks(self, dp_rank: int, pp_rank: int) -> list[int]:
        """Global ranks of the tensor-parallel group at ``(dp_rank, pp_rank)``, by ``tp_rank``."""
        return [self.rank_of(dp_rank, pp_rank, t) for t in range(self.tensor_parallel_size)]

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of the pipeline that ``rank`` belongs to, indexed by ``pp_rank``."""
        c = self.coordinates(rank)
        return [self.rank_of(c.dp_rank, p, c.tp_rank) for p in range(self.pipeline_parallel_size)]

    def __str__(self) -> str:
        experts = f" (ep={self.expert_parallel_size})" if self.expert_parallel_size > 1 else ""
        if self.context_parallel_size > 1:
            experts += f" (cp={self.context_parallel_size})"
        return (
            f"dp={self.data_parallel_size}{experts} x pp={self.pipeline_parallel_size} x "
            f"tp={self.tensor_parallel_size}"
        )


def _spans(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def check_tensor_groups_in_nodes(tensor_parallel_size: int, processes_per_node: int, num_nodes: int) -> None:
    """Refuse, before launch, a tensor-parallel size whose groups would span nodes.

    Launchers number each node's ranks contiguously and the tensor axis is innermost, so a group
    ``tp_rank 0..tp-1`` is ``tp`` consecutive ranks: inside one node when ``tp`` divides the
    processes per node, across two otherwise (its all-reduces, on every layer, over the network).
    """
    tp, per_node = tensor_parallel_size, processes_per_node
    if num_nodes <= 1 or per_node % tp == 0:
        return
    fits = divisors(per_node)
    raise ValueError(
        f"tensor_parallel_size={tp} does not divide the {per_node} processes (devices) per node on "
        f"{num_nodes} nodes, so a tensor-parallel group would span two nodes and its all-reduces, on "
        f"every layer, would cross the network. Each tensor-parallel group must sit inside one node "
        f"(the pipeline and data axes cross nodes): use a tensor_parallel_size that divides {per_node} "
        f"(one of {fits}) and give the other factor to pipeline_parallel_size, or use {tp} (or a "
        f"multiple of {tp}) devices per node."
    )


@dataclass(frozen=True)
class NodePlacement:
    """The node each global rank runs on: the launcher's node rank (torchrun's ``GROUP_RANK``,
    Lightning's ``NODE_RANK``, ``SLURM_NODEID``) and the host's name, indexed by global rank."""

    node_ranks: tuple[int, ...]
    hostnames: tuple[str, ...]

    @classmethod
    def gather(cls, node_rank: int | None = None, group: dist.ProcessGroup | None = None) -> NodePlacement:
        """Every rank's node, from every rank (collective over the default group: call it on all
        ranks, after the device is set under NCCL). Without ``node_rank``, nodes are numbered by
        host name, in the order of their first rank."""
        mine = (node_rank, socket.gethostname())
        everyone: list[tuple[int | None, str]] = [mine] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        hosts = tuple(h for _, h in everyone)
        if all(n is not None for n, _ in everyone):
            return cls(tuple(int(n) for n, _ in everyone), hosts)  # type: ignore[arg-type]
        numbers = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
        return cls(tuple(numbers[h] for h in hosts), hosts)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_ranks))

    def ranks_on(self, node_rank: int) -> list[int]:
        return [r for r, n in enumerate(self.node_ranks) if n == node_rank]

    def label(self, rank: int) -> str:
        """``"node 1 (host-b)"``: where ``rank`` runs."""
        return f"node {self.node_ranks[rank]} ({self.hostnames[rank]})"

    def check(self, layout: ParallelLayout) -> None:
        """Raise unless every tensor-parallel group of ``layout`` sits inside one node."""
        if len(self.node_ranks) != layout.world_size:
            raise ValueError(
                f"{len(self.node_ranks)} ranks placed on nodes, but {layout} has {layout.world_size}"
            )
        for dp_rank in range(layout.data_parallel_size):
            for pp_rank in range(layout.pipeline_parallel_size):
                ranks = layout.tensor_ranks(dp_rank, pp_rank)
                nodes = sorted({self.node_ranks[r] for r in ranks})
                if len(nodes) == 1:
                    continue
                where = ", ".join(f"rank {r} on {self.label(r)}" for r in ranks)
                per_node = sorted({len(self.ranks_on(n)) for n in set(self.node_ranks)})
                raise ValueError(
                    f"The tensor-parallel group of dp_rank {dp_rank}, pp_rank {pp_rank} spans nodes "
                    f"{nodes} ({where}): its all-reduces, on every layer, would cross the network. "
                    f"Ranks are laid out tensor-innermost (rank = (dp_rank x pp + pp_rank) x tp + "
                    f"tp_rank, {layout}), so each group is {layout.tensor_parallel_size} consecutive "
                    f"global ranks; with {per_node} processes per node, it sits inside one node when "
                    f"tensor_parallel_size divides the processes per node and the launcher numbers each "
                    "node's ranks contiguously (torchrun and Lightning do; under SLURM use the default "
                    "block distribution, not --distribution=cyclic)."
                )

    def describe(self, layout: ParallelLayout) -> str:
        """Per node, its ranks and the pipeline stages and tensor groups they hold (layout log)."""
        lines = [
            f"  nodes: {self.num_nodes}; each tensor-parallel group inside one node, the pipeline and "
            "data axes across nodes"
        ]
        for node in sorted(set(self.node_ranks)):
            ranks = self.ranks_on(node)
            hosts = ", ".join(dict.fromkeys(self.hostnames[r] for r in ranks))
            held = []
            for dp_rank in range(layout.data_parallel_size):
                for pp_rank in range(layout.pipeline_parallel_size):
                    group = layout.tensor_ranks(dp_rank, pp_rank)
                    if set(group) <= set(ranks):
                        held.append(f"dp_rank {dp_rank} pp_rank {pp_rank}")
            lines.append(f"    node {node} ({hosts}): ranks {_spans(ranks)}: {'; '.join(held)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ParallelMesh:
    """A layout bound to this process: its coordinates and the DeviceMesh with one group per axis.

    ``model_group`` holds the ranks of this rank's model replica (all pipeline and tensor ranks of
    one data-parallel index): what a global gradient norm or a found-inf flag is agreed over.

    ``host_model_group``, ``host_pipeline_group`` and ``host_data_group``: the same ranks over
    gloo, for values the host holds (a batch's shapes, the structure of a step's logged values,
    token counts) when the device's groups are NCCL: a host collective makes the host wait for its
    peers, never for its device's queue. ``None`` (CPU): the device's groups are gloo already.
    """

    layout: ParallelLayout
    rank: int
    device_mesh: DeviceMesh
    model_group: dist.ProcessGroup
    host_model_group: dist.ProcessGroup | None = None
    host_pipeline_group: dist.ProcessGroup | None = None
    host_data_group: dist.ProcessGroup | None = None
    nodes: NodePlacement | None = None
    """Where every rank runs (checked: each tensor-parallel group inside one node), when known."""
    expert_mesh: DeviceMesh | None = None
    """With ``expert_parallel_size > 1``: the data axis of this rank's ``(pp_rank, tp_rank)`` as a
    2-D mesh ``("expert_data", "expert")`` (:func:`init_mesh`); ``None`` otherwise."""
    context_group: dist.ProcessGroup | None = None
    """With ``context_parallel_size > 1``: the ranks that split this rank's sequences (ring
    attention's group, :meth:`ParallelLayout.context_ranks`); ``None`` otherwise."""
    _subgroups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup | None] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def subgroup(self, groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
        """This rank's group among ``groups`` (lists of global ranks), ``None`` when it is in none.

        Collective the first time: every rank creates every group, in the same order, so every
        rank asks for the same lists in the same order. Later calls with the same lists return the
        groups made then: a runtime built again over this mesh (validate, test or predict after
        fit) reuses them instead of adding a set of groups (their threads and connections; on
        NCCL, their communicators' device buffers) with every Trainer call. The groups have the
        default backend (the device's): the lists alone are the key.
        """
        key = tuple(tuple(ranks) for ranks in groups)
        if key not in self._subgroups:
            self._subgroups[key] = _own_group(key, self.rank)
        return self._subgroups[key]

    def is_live(self) -> bool:
        """Whether this mesh's groups still exist (``destroy_process_group()`` destroys every
        group, and a process group initialised afterwards knows none of them)."""
        try:
            dist.get_process_group_ranks(self.model_group)
        except (KeyError, ValueError, RuntimeError):
            return False
        return True

    @property
    def expert_group(self) -> dist.ProcessGroup | None:
        """The ranks that split this rank's experts (all-to-all of tokens); ``None`` without an
        expert axis (every data rank holds every expert)."""
        return None if self.expert_mesh is None else self.expert_mesh.get_group("expert")

    @property
    def expert_data_group(self) -> dist.ProcessGroup:
        """The ranks holding the same experts as this rank: what expert gradients are reduced
        (and, under ZeRO-1 or FSDP2, expert state sharded) over. The data group without an expert
        axis."""
        if self.expert_mesh is None:
            return self.group(MeshAxis.DATA)
        return self.expert_mesh.get_group("expert_data")

    @property
    def coordinates(self) -> RankCoordinates:
        return self.layout.coordinates(self.rank)

    def group(self, axis: MeshAxis) -> dist.ProcessGroup:
        return self.device_mesh.get_group(axis.value)

    def host_group(self, axis: MeshAxis | None = None) -> dist.ProcessGroup:
        """The group of ``axis`` (``None``: the model replica) that takes host tensors."""
        if axis is None:
            return self.host_model_group or self.model_group
        host = {MeshAxis.PIPELINE: self.host_pipeline_group, MeshAxis.DATA: self.host_data_group}.get(axis)
        if host is not None:
            return host
        if self.host_model_group is not None:  # NCCL groups, and no gloo twin of this axis
            raise ValueError(
                f"No host group for the {axis.value} axis (the replica, pipeline and data only)."
            )
        return self.group(axis)

    @property
    def pipeline_peers(self) -> list[int]:
        return self.layout.pipeline_ranks(self.rank)


def init_mesh(layout: ParallelLayout, device_type: str, nodes: NodePlacement | None = None) -> ParallelMesh:
    """Build the DeviceMesh for ``layout`` over the initialised default process group.

    ``device_type`` is ``"cuda"`` (NCCL groups) or ``"cpu"`` (gloo groups); ``nodes``: where the
    ranks run (:meth:`NodePlacement.gather`), refused when a tensor-parallel group spans nodes.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed to be initialised first.")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"The layout {layout} needs {layout.world_size} processes but the world has {world}."
        )
    if nodes is not None:  # the same placement on every rank: all refuse together
        nodes.check(layout)
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=tuple(a.value for a in MeshAxis))
    rank = dist.get_rank()
    dp, pp, tp = layout.data_parallel_size, layout.pipeline_parallel_size, layout.tensor_parallel_size
    replicas = [layout.replica_ranks(dp_rank) for dp_rank in range(dp)]
    model_group = _own_group(replicas, rank)
    if model_group is None:  # unreachable: the ranges above cover the world
        raise RuntimeError(f"rank {rank} is in no model-parallel group of {layout}")
    host_model = host_pipeline = host_data = None
    if device_type == "cuda":  # gloo twins of the groups that carry host values (see ParallelMesh)
        host_model = _own_group(replicas, rank, "gloo")
        pipelines = [layout.pipeline_ranks(layout.rank_of(d, 0, t)) for d in range(dp) for t in range(tp)]
        host_pipeline = _own_group(pipelines, rank, "gloo")
        datas = [[layout.rank_of(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
        host_data = _own_group(datas, rank, "gloo")
    expert_mesh = None
    if layout.expert_parallel_size > 1:
        # rank = (expert_replica x E + ep_rank) x (pp x tp) + model rank: the expert index is the
        # middle dim, the replica of the experts the outer one (collective: every rank builds it).
        e = layout.expert_parallel_size
        world_mesh = init_device_mesh(
            device_type,
            (layout.data_parallel_size // e, e, layout.pipeline_parallel_size * layout.tensor_parallel_size),
            mesh_dim_names=("expert_data", "expert", "model"),
        )
        expert_mesh = world_mesh["expert_data", "expert"]
    context_group = None
    if layout.context_parallel_size > 1:
        firsts = [first for first in range(layout.world_size) if layout.cp_rank(first) == 0]
        context_group = _own_group([layout.context_ranks(first) for first in firsts], rank)
    _let_workers_finish_at_exit()
    return ParallelMesh(
        layout,
        rank,
        mesh,
        model_group,
        host_model,
        host_pipeline,
        host_data,
        nodes,
        expert_mesh,
        context_group,
    )


def _own_group(
    groups: Sequence[Sequence[int]], rank: int, backend: str | None = None
) -> dist.ProcessGroup | None:
    """A process group for each list of global ranks in ``groups``; ``rank``'s own (``None`` when
    it is in none). ``new_group`` is collective: every rank creates every group, in the same order,
    so every rank calls this with the same lists."""
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            mine = group
    return mine


def check_expert_parallel_size(expert_parallel_size: int, data_parallel_size: int) -> None:
    """Raise unless ``expert_parallel_size`` is a count that divides ``data_parallel_size`` (the
    expert axis borrows from the data axis)."""
    _check_borrowed_axis("expert", expert_parallel_size, data_parallel_size, "the experts")


def check_context_parallel_size(context_parallel_size: int, data_parallel_size: int) -> None:
    """Raise unless ``context_parallel_size`` is a count that divides ``data_parallel_size`` (the
    context axis borrows from the data axis)."""
    _check_borrowed_axis("context", context_parallel_size, data_parallel_size, "every sequence")


def _check_borrowed_axis(axis: str, size: int, data_parallel_size: int, splits: str) -> None:
    """The rule of an axis carved from the data axis: its size is a count dividing the data size."""
    name = f"{axis}_parallel_size"
    check_count(name, size)
    if data_parallel_size % size != 0:
        raise ValueError(
            f"{name}={size} does not divide data_parallel_size={data_parallel_size}: the {axis} axis "
            f"borrows from the data axis (each group of {name} data-parallel ranks splits {splits}). "
            f"Use one of {divisors(data_parallel_size)}, or more data-parallel ranks (with "
            "data_parallel_size='auto', more processes)."
        )


def check_replicate_size(replicate_size: int, data_parallel_size: int) -> None:
    """Raise unless HSDP's ``replicate_size`` replicas split ``data_parallel_size`` ranks evenly
    (one sentence naming both options; the strategy calls it before launch, the mesh again)."""
    if data_parallel_size % replicate_size != 0:
        raise ValueError(
            f"data_parallel_replicate_size={replicate_size} does not divide data_parallel_size="
            f"{data_parallel_size}: HSDP splits the {data_parallel_size} data-parallel ranks into replicas "
            f"of equal shard groups. Use one of {divisors(data_parallel_size)}."
        )


def data_parallel_mesh(mesh: ParallelMesh, replicate_size: int = 1) -> DeviceMesh:
    """The data axis as FSDP2 takes it: 1-D (every data-parallel rank holds different shards), or
    for HSDP 2-D, ``("dp_replicate", "dp_shard")``: ``replicate_size`` replicas of
    ``data_parallel_size / replicate_size`` shards each, the shard index innermost (shards talk at
    every gather and reduction, replicas once per step), so that ``dp_rank = replica x shards +
    shard``.

    Collective over the world when ``replicate_size > 1`` (it builds that mesh's groups): every
    rank calls it, with the same size.
    """
    dp = mesh.layout.data_parallel_size
    if replicate_size == 1:
        return mesh.device_mesh[MeshAxis.DATA.value]
    check_replicate_size(replicate_size, dp)
    per_replica = mesh.layout.pipeline_parallel_size * mesh.layout.tensor_parallel_size
    # rank = dp_rank x (pp x tp) + (pp_rank x tp + tp_rank): the last dim is a replica's model ranks.
    world = init_device_mesh(
        mesh.device_mesh.device_type,
        (replicate_size, dp // replicate_size, per_replica),
        mesh_dim_names=("dp_replicate", "dp_shard", "model"),
    )
    return world["dp_replicate", "dp_shard"]


_EXIT_GRACE_S = 0.1
_exit_hook_registered = False


def _let_workers_finish_at_exit() -> None:
    """Give the process groups' worker threads a moment, at exit, to release finished work.

    A gloo worker thread frees a finished collective's work object after the caller has already
    returned; if that object holds the last reference to a tensor created in Python (the
    temporaries of ``gather_object``), freeing it needs the GIL. When the main thread has begun
    interpreter finalization by then, taking the GIL ends the worker thread inside a C++ frame
    that must not unwind, and the process aborts ("terminate called without an active exception",
    exit code -6) after a run that succeeded: pytorch/pytorch#190489. An exit handler runs while
    the interpreter is still whole; sleeping there releases the GIL to those threads.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(time.sleep, _EXIT_GRACE_S)
