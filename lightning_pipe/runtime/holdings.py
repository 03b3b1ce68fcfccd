"""What each stage holds: whole-model and per-rank parameter elements, gathered once at setup.

No rank sees the whole model with values (other stages' parameters are meta tensors, tensor-parallel
layers are slices), so each stage describes its own parameters after sharding and the pipeline
all-gathers the descriptions; the layout log and the model summary read them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim


@dataclass(frozen=True)
class Holdings:
    """Whole and per-rank parameter elements of every stage, gathered from the stages at setup."""

    parameters: dict[str, tuple[int, int]]
    """Every parameter path inside the pipeline layers (all names of a shared tensor) -> (elements
    in the whole model, elements one rank of its stage holds)."""
    per_stage: tuple[tuple[int, int], ...]
    """For each stage: (distinct elements in the whole model, elements one of its ranks holds)."""

    def per_rank(self, stage_index: int) -> int:
        return self.per_stage[stage_index][1]


def gather_holdings(
    module: nn.Module,
    partition: PipelinePartition,
    stages: Collection[int],
    tensor_parallel_size: int,
    group: dist.ProcessGroup | None,
) -> Holdings:
    """Describe the parameters of this rank's ``stages`` (after tensor-parallel sharding) and
    all-gather the descriptions over the pipeline ``group`` (``None``: one rank)."""
    Entry = tuple[int, dict[str, tuple[int, int]], tuple[int, int]]
    mine: list[Entry] = []
    for stage_index in sorted(stages):
        parameters: dict[str, tuple[int, int]] = {}
        seen: set[int] = set()
        whole = held = 0
        for path, param in module.named_parameters(remove_duplicate=False):
            if partition.stage_of_key(path) != stage_index:
                continue
            local = param.numel()
            full = local * tensor_parallel_size if tensor_parallel_dim(param) is not None else local
            parameters[path] = (full, local)
            if id(param) not in seen:
                seen.add(id(param))
                whole, held = whole + full, held + local
        mine.append((stage_index, parameters, (whole, held)))
    gathered: list[list[Entry]] = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        gathered = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, mine, group=group)
    entries = sorted((entry for rank in gathered for entry in rank), key=lambda entry: entry[0])
    everything: dict[str, tuple[int, int]] = {}
    for _, stage_parameters, _ in entries:
        everything.update(stage_parameters)
    return Holdings(everything, tuple(totals for _, _, totals in entries))
