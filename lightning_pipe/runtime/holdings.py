"""What each stage holds: whole-model and per-rank parameter elements, gathered once at setup.

No rank sees the whole model with values (other stages' parameters are meta tensors, tensor-parallel
layers are slices), so each stage describes its own parameters after sharding and the pipeline
all-gathers the descriptions; the layout log and the model summary read them (issue 16, item 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lightning_pipe.pipeline.plan import PipelinePlan
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
    plan: PipelinePlan,
    stage_index: int,
    tensor_parallel_size: int,
    group: dist.ProcessGroup | None,
) -> Holdings:
    """Describe this stage's parameters (after tensor-parallel sharding) and all-gather the
    description over the pipeline ``group`` (``None``: one stage)."""
    mine: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    whole = held = 0
    for path, param in module.named_parameters(remove_duplicate=False):
        if plan.stage_of_key(path) != stage_index:
            continue
        local = param.numel()
        full = local * tensor_parallel_size if tensor_parallel_dim(param) is not None else local
        mine[path] = (full, local)
        if id(param) not in seen:
            seen.add(id(param))
            whole, held = whole + full, held + local
    entries: list[tuple[int, dict[str, tuple[int, int]], tuple[int, int]]] = [
        (stage_index, mine, (whole, held))
    ]
    if group is not None and dist.get_world_size(group) > 1:
        entries = [(0, {}, (0, 0))] * dist.get_world_size(group)
        dist.all_gather_object(entries, (stage_index, mine, (whole, held)), group=group)
    entries.sort(key=lambda entry: entry[0])
    parameters: dict[str, tuple[int, int]] = {}
    for _, stage_parameters, _ in entries:
        parameters.update(stage_parameters)
    return Holdings(parameters, tuple(totals for _, _, totals in entries))
