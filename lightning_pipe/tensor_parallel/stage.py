"""Shard exactly the modules of one pipeline stage, found by identity, and say what was sharded.

A tensor-parallel plan names modules relative to the whole model, but a pipeline stage owns
*layers*, which may reach the same modules under other names (a Hugging Face model kept as
``self.llama`` and cut into wrappers ``self.pipe[i]`` that hold ``self.llama.model.layers[i]``).
Deciding by name would compare ``llama.model.layers.0...`` with ``pipe.1`` and shard nothing, and
every tensor rank would then silently run the whole model. So a module's stage is decided by
identity: it belongs to the stages whose layers contain that very object.

Before slicing, the stage's full weights are made identical on every rank of its tensor group
(a broadcast from tensor rank 0): without ``seed_everything`` each rank initialised its own
weights, and slices of different tensors would form a model no single device ever had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.tensor_parallel.apply import apply_plan
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle


@dataclass(frozen=True)
class StageSlicing:
    """What a tensor-parallel plan shards on each pipeline stage (counted on the full model)."""

    modules: tuple[int, ...]
    """Number of modules the plan shards, per stage."""
    elements: tuple[int, ...]
    """Parameter elements of those modules before slicing, per stage."""
    outside: tuple[str, ...]
    """Modules the plan matches that belong to no pipeline layer (left whole)."""

    def describe(self, tp_size: int) -> str:
        lines = [
            # Elements of the planned modules (a row-parallel bias among them, though replicated):
            # the exact count per rank is on the stage's line of the layout log.
            f"  stage {s}: {n} modules sharded over {tp_size} tensor ranks ({e:,} parameter elements)"
            for s, (n, e) in enumerate(zip(self.modules, self.elements, strict=True))
        ]
        if self.outside:
            lines.append(f"  not sharded (outside every pipeline layer): {list(self.outside)}")
        return "\n".join(lines)


def stages_of_modules(layers: Sequence[nn.Module], stage_of_layer: Sequence[int]) -> dict[int, set[int]]:
    """``id(module)`` -> the stages whose layers contain that module (usually one)."""
    stages: dict[int, set[int]] = {}
    for layer, stage in zip(layers, stage_of_layer, strict=True):
        for sub in layer.modules():
            stages.setdefault(id(sub), set()).add(stage)
    return stages


def count_slicing(
    model: nn.Module,
    resolved: Mapping[str, TensorParallelStyle],
    layers: Sequence[nn.Module],
    stage_of_layer: Sequence[int],
    num_stages: int,
) -> StageSlicing:
    """Count, per stage, the modules and parameter elements ``resolved`` shards.

    Raises ``ValueError`` when the plan matches modules but none of them lies inside a pipeline
    layer: nothing would be sharded, and every tensor rank would run the whole model.
    """
    owner = stages_of_modules(layers, stage_of_layer)
    modules, elements = [0] * num_stages, [0] * num_stages
    outside = []
    for name, style in resolved.items():
        if style is TensorParallelStyle.REPLICATED_SUM or style.is_sequence:
            continue  # kept whole (its gradients summed, or the sequence split around it): not sharded
        module = model.get_submodule(name)
        stages = owner.get(id(module))
        if not stages:
            outside.append(name)
            continue
        for stage in stages:
            modules[stage] += 1
            if style is not TensorParallelStyle.DROPOUT:
                elements[stage] += sum(p.numel() for p in module.parameters())
    if resolved and not any(modules):
        raise ValueError(
            f"The tensor-parallel plan matches {len(resolved)} modules (e.g. {sorted(resolved)[:3]}), but "
            "none of them is inside a layer returned by configure_pipeline(), so nothing would be "
            "sharded and every tensor rank would run the whole model. Make configure_pipeline() return "
            "the layers that hold these modules (wrappers around them are fine)."
        )
    return StageSlicing(tuple(modules), tuple(elements), tuple(outside))


def slice_stage(
    model: nn.Module,
    resolved: Mapping[str, TensorParallelStyle],
    own_layers: Sequence[nn.Module],
    group: dist.ProcessGroup,
    src: int,
    seed: int,
    sequence_parallel: bool = False,
) -> list[str]:
    """Make ``own_layers`` equal to tensor rank ``src``'s (a global rank), then shard the modules
    of ``resolved`` that lie inside them; returns the names of the sharded modules."""
    # Meta tensors (a model built without storage) get equal values when materialised instead.
    tensors = [t for layer in own_layers for t in (*layer.parameters(), *layer.buffers())]
    broadcast_parameters([t for t in tensors if not t.is_meta], group, src)
    own = {id(sub) for layer in own_layers for sub in layer.modules()}
    return apply_plan(
        model,
        resolved,
        group,
        seed,
        include=lambda module: id(module) in own,
        sequence_parallel=sequence_parallel,
    )
