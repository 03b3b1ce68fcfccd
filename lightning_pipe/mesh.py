"""The parallel layout: data x pipeline x tensor, and the device mesh built from it.

Ranks are laid out with the data axis outermost and the tensor axis innermost,
``rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank``, so tensor-parallel peers, which
talk on every layer, are neighbours (the same node on a real cluster), pipeline neighbours come
next, and data-parallel replicas, which talk once per step, are furthest apart (Megatron-LM's
ordering, Narayanan et al., 2021).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three axes; their product is the world size."""

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")

    @classmethod
    def resolve(
        cls,
        world_size: int,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
    ) -> ParallelLayout:
        """Fill in ``data_parallel_size="auto"`` and check that the sizes multiply to the world."""
        pp, tp = pipeline_parallel_size, tensor_parallel_size
        for name, value in (("pipeline_parallel_size", pp), ("tensor_parallel_size", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if data_parallel_size == "auto":
            if world_size % (pp * tp) != 0:
                raise ValueError(
                    f"pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp}) = {pp * tp} does "
                    f"not divide the world size {world_size}, so no data-parallel size fits. Use a "
                    f"number of processes that is a multiple of {pp * tp}, or change the sizes."
                )
            data_parallel_size = world_size // (pp * tp)
        layout = cls(data_parallel_size, pp, tp)
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

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of the pipeline that ``rank`` belongs to, indexed by ``pp_rank``."""
        c = self.coordinates(rank)
        return [self.rank_of(c.dp_rank, p, c.tp_rank) for p in range(self.pipeline_parallel_size)]

    def __str__(self) -> str:
        return (
            f"dp={self.data_parallel_size} x pp={self.pipeline_parallel_size} x "
            f"tp={self.tensor_parallel_size}"
        )


@dataclass(frozen=True)
class ParallelMesh:
    """A layout bound to this process: its coordinates and the DeviceMesh with one group per axis."""

    layout: ParallelLayout
    rank: int
    device_mesh: DeviceMesh

    @property
    def coordinates(self) -> RankCoordinates:
        return self.layout.coordinates(self.rank)

    def group(self, axis: MeshAxis) -> dist.ProcessGroup:
        return self.device_mesh.get_group(axis.value)

    @property
    def pipeline_peers(self) -> list[int]:
        return self.layout.pipeline_ranks(self.rank)


def init_mesh(layout: ParallelLayout, device_type: str) -> ParallelMesh:
    """Build the DeviceMesh for ``layout`` over the initialised default process group.

    ``device_type`` is ``"cuda"`` (NCCL groups) or ``"cpu"`` (gloo groups).
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed to be initialised first.")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"The layout {layout} needs {layout.world_size} processes but the world has {world}."
        )
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=tuple(a.value for a in MeshAxis))
    return ParallelMesh(layout, dist.get_rank(), mesh)
