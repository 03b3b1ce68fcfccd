"""Which experts a parameter holds: the mark every expert-parallel parameter carries.

A mixture-of-experts layer's expert weights are stacked along one dim, the *expert dim*
(Hugging Face's fused ``gate_up_proj`` / ``down_proj``: ``(num_experts, ...)``). Under expert
parallelism each rank of an expert group keeps a contiguous block of that dim, and the parameter
is marked with an :class:`ExpertShard` (as tensor-parallel parameters are marked with
``tensor_parallel_dim``). Everything that must treat expert parameters apart reads the mark and
nothing else: the gradient reduction (over the expert-data group, not the whole data axis),
gradient clipping (a norm summed over the expert group: each expert counted once), ZeRO-1 and
FSDP2 (sharding over the expert-data group), and checkpoints (saved by global expert index, so a
run saved with one expert size resumes with any other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTRIBUTE = "expert_shard"


@dataclass(frozen=True)
class ExpertShard:
    """A block of ``local_experts`` experts, starting at global expert ``first_expert`` of
    ``num_experts``, stacked along ``dim`` of the parameter."""

    num_experts: int
    first_expert: int
    local_experts: int
    dim: int = 0

    def __post_init__(self) -> None:
        if not (
            0 < self.local_experts <= self.num_experts
            and 0 <= self.first_expert
            and self.first_expert + self.local_experts <= self.num_experts
        ):
            raise ValueError(
                f"experts [{self.first_expert}, {self.first_expert + self.local_experts}) are not a "
                f"block of the {self.num_experts} experts."
            )

    @property
    def expert_parallel_size(self) -> int:
        """How many equal blocks the experts were split into."""
        return self.num_experts // self.local_experts

    @property
    def experts(self) -> range:
        """The global indices of the experts held."""
        return range(self.first_expert, self.first_expert + self.local_experts)


def mark_expert_shard(param: torch.Tensor, shard: ExpertShard) -> None:
    """Mark ``param`` as holding the experts of ``shard`` (its ``shard.dim`` has
    ``shard.local_experts`` entries)."""
    if param.shape[shard.dim] != shard.local_experts:
        raise ValueError(
            f"a parameter of shape {tuple(param.shape)} cannot hold {shard.local_experts} experts along "
            f"dim {shard.dim}."
        )
    setattr(param, _ATTRIBUTE, shard)


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    """The experts ``param`` holds, or ``None`` for a parameter every rank of an expert group holds
    whole (routers, shared experts, everything outside the experts)."""
    shard = getattr(param, _ATTRIBUTE, None)
    return shard if isinstance(shard, ExpertShard) else None


def held_block(param: torch.Tensor | None) -> ExpertShard | None:
    """The experts ``param`` holds when it holds some of them only (expert parallelism): a block
    that checkpoints save by global expert index and FSDP2 shards over the expert-data group.
    ``None`` for every other parameter, and for one marked as holding all its experts."""
    shard = expert_shard(param) if param is not None else None
    return shard if shard is not None and shard.local_experts < shard.num_experts else None
