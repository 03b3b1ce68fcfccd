"""Save and load one rank's part of a checkpoint directory, described by a :class:`RankPart`.

A checkpoint is a dictionary as Lightning writes one: ``state_dict`` (the model),
``optimizer_states`` (one per optimizer) and anything else (loop counters, schedulers, a training
script's own state). Here ``state_dict`` and each optimizer's ``state`` hold *this rank's* part,
keyed by the unsharded model's names; :func:`write` makes every rank of the first replica (the first
expert group, under expert parallelism) write its file into one directory, and :func:`read` gives
each rank back its own entries, already cut for the current layout, whatever layout wrote them
(:mod:`lightning_pipe.checkpoint`).

What a rank holds reaches this module as a small value, :class:`RankPart`, and optimizers as the
views checkpoints see (a ZeRO-1 optimizer's unsharded view): the checkpoint code knows nothing of
the runtime that trains the model, which calls it (:meth:`ParallelRuntime.save_checkpoint
<lightning_pipe.runtime.ParallelRuntime.save_checkpoint>`), as does the Lightning adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.metadata import (
    EXPERT_LAYOUT_KEY,
    CheckpointError,
    CheckpointMetadata,
    part_file_name,
)
from lightning_pipe.checkpoint.optimizer_view import local_groups, local_to_whole
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.state import (
    check_keys,
    check_shapes,
    holds_key,
    load_model_part,
    load_optimizer_part,
    model_entries,
    model_part,
    optimizer_entries,
    optimizer_part,
    parameter_names,
    slice_for,
    slice_optimizer_state,
    writes_value,
)
from lightning_pipe.checkpoint.writer import PartFile, write_checkpoint_directory
from lightning_pipe.data_parallel.sharded_state import gather_whole, shard_like
from lightning_pipe.mesh import ParallelLayout, RankCoordinates
from lightning_pipe.partition.model import PipelinePartition

FROM_DIRECTORY = "pipe_tp_sharded_checkpoint"
"""Marks a checkpoint dictionary read from a checkpoint directory (its entries are this rank's)."""


@dataclass(frozen=True)
class RankPart:
    """What one rank holds, as a checkpoint sees it."""

    module: nn.Module
    """The whole model (other stages' parameters meta tensors, tensor-parallel layers slices)."""
    partition: PipelinePartition
    stages: tuple[int, ...]
    """The stages this rank holds."""
    layout: ParallelLayout
    coordinates: RankCoordinates
    parameters: frozenset[int]
    """``id()`` of this rank's trainable parameters (its stages' layers)."""
    is_writer: bool
    """Whether this rank writes the metadata and the rest of the checkpoint (global rank 0)."""

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert group (0 without an expert axis)."""
        return self.coordinates.dp_rank % self.layout.expert_parallel_size

    @property
    def writes_part(self) -> bool:
        """Whether this rank writes a part file: the ranks of the first replica, which under expert
        parallelism is the first expert group (the data ranks ``0 .. E-1``, whose experts together
        are every expert)."""
        return self.coordinates.dp_rank < self.layout.expert_parallel_size


def model_state(part: RankPart) -> dict[str, Any]:
    """This rank's part of the model state, keyed by the unsharded model's names.

    Collective over the data axis under ``shard_parameters``: each parameter is gathered whole
    from its shards, one at a time, and kept, on the host, by the rank that writes it only (the
    first replica; of an expert parameter, the first expert group).
    """
    c = part.coordinates
    # Every expert rank takes part in every gather (what ep_rank 0 writes), then keeps its own.
    state = model_part(part.module, part.partition, part.stages, c.tp_rank)
    params = part.module.state_dict(keep_vars=True)
    out = {}
    for key, value in state.items():
        param = params[key] if isinstance(params.get(key), torch.Tensor) else None
        writes = part.writes_part and writes_value(value, param, c.tp_rank, part.ep_rank)
        # On the host at once: the writer never holds its whole stage on the device.
        gathered = gather_whole(value, writes, to_host=True)
        if writes:
            out[key] = gathered
    return out


def optimizer_state(part: RankPart, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state (the view checkpoints see), keyed by parameter
    name, with its groups."""
    c = part.coordinates
    return optimizer_part(optimizer, part.module, part.partition, part.stages, c.tp_rank, part.ep_rank)


def write(part: RankPart, path: str | Path, checkpoint: dict[str, Any]) -> None:
    """Collective over the world: write ``checkpoint`` (its ``state_dict`` and optimizer
    ``state`` entries this rank's parts) as the checkpoint directory ``path``; the writer (global
    rank 0) writes the rest of the dictionary and the metadata."""
    c, layout = part.coordinates, part.layout
    tp, module = layout.tensor_parallel_size, part.module
    checkpoint = dict(checkpoint)
    model = checkpoint.pop("state_dict")
    optimizers = checkpoint.pop("optimizer_states", None)
    file = part_file_name(c.pp_rank, c.tp_rank, part.ep_rank)
    mine = None
    if part.writes_part:  # the other replicas hold the same values
        mine = PartFile(
            file,
            {"model": model, "optimizers": [o["state"] for o in optimizers or []]},
            model_entries(model, module, tp, c.tp_rank, file),
            [optimizer_entries(o["state"], module, tp, c.tp_rank, file) for o in optimizers or []],
        )
    if optimizers is not None:
        checkpoint["optimizer_states"] = [{k: v for k, v in o.items() if k != "state"} for o in optimizers]
    header = CheckpointMetadata(
        layout={
            "data_parallel_size": layout.data_parallel_size,
            "pipeline_parallel_size": layout.pipeline_parallel_size,
            "tensor_parallel_size": tp,
            EXPERT_LAYOUT_KEY: layout.expert_parallel_size,
        },
        layer_names=list(part.partition.layer_names),
        balance=list(part.partition.balance),
    )
    write_checkpoint_directory(
        path,
        mine,
        checkpoint if part.is_writer else None,
        header if part.is_writer else None,
        key_order=list(module.state_dict().keys()),
    )


def read(
    part: RankPart,
    path: str | Path,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: bool | None = True,
) -> dict[str, Any]:
    """The checkpoint dictionary at ``path`` with this rank's model entries and, for each of
    ``optimizers`` (the views checkpoints see), its state for this rank's parameters, numbered
    for it and cut for this layout."""
    reader = CheckpointDirectory(path)
    # Before the keys are compared with the model's: metadata that lost (or gained) an entry is a
    # damaged checkpoint, not one of another model, and must not be told as a key mismatch.
    reader.check_complete()
    c, tp = part.coordinates, part.layout.tensor_parallel_size
    checkpoint = reader.lightning_state(weights_only)
    checkpoint["state_dict"] = load_model_part(
        reader, part.module, part.partition, part.stages, tp, c.tp_rank, strict
    )
    checkpoint[FROM_DIRECTORY] = {"keys": list(reader.metadata.model), "layout": reader.metadata.layout}
    saved = checkpoint.get("optimizer_states")
    if saved is not None and optimizers:
        check_optimizer_count(len(saved), len(optimizers))
        checkpoint["optimizer_states"] = [
            load_optimizer_part(reader, i, entry, opt, part.module, set(part.parameters), tp, c.tp_rank)
            for i, (entry, opt) in enumerate(zip(saved, optimizers, strict=True))
        ]
    return checkpoint


def load_model(part: RankPart, checkpoint: dict[str, Any], strict: bool = True) -> None:
    """Load this stage's entries of ``checkpoint`` (from :func:`read`, or an ordinary single-file
    checkpoint, whose full tensors are cut to this rank's slice)."""
    tp, tp_rank = part.layout.tensor_parallel_size, part.coordinates.tp_rank
    current = part.module.state_dict(keep_vars=True)
    saved = checkpoint["state_dict"]
    directory = checkpoint.get(FROM_DIRECTORY)
    if strict:
        check_keys(directory["keys"] if directory else saved, current, "The checkpoint")
    if not directory:  # a plain checkpoint holds full tensors (a directory was checked on read)
        shapes = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
        check_shapes(shapes, current, tp, "The checkpoint")
    state = {
        # A whole tensor cut to this tensor rank's slice, then (shard_parameters) to its shard.
        k: shard_like(
            slice_for(v, current.get(k) if isinstance(current.get(k), torch.Tensor) else None, tp, tp_rank),
            current.get(k),
        )
        for k, v in saved.items()
        if k in current and holds_key(part.partition, k, part.stages)
    }
    part.module.load_state_dict(state, strict=False)


def load_optimizers(
    part: RankPart, checkpoint: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Load each optimizer's entries (``optimizers``: the views checkpoints see) for this rank's
    parameters, cutting full tensors (an ordinary checkpoint numbers the whole model's
    parameters, as one device does)."""
    tp, tp_rank = part.layout.tensor_parallel_size, part.coordinates.tp_rank
    check_optimizer_count(len(checkpoint["optimizer_states"]), len(optimizers))
    for optimizer, saved in zip(optimizers, checkpoint["optimizer_states"], strict=True):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        entries, groups = saved["state"], saved["param_groups"]
        if FROM_DIRECTORY not in checkpoint:
            # A checkpoint directory was numbered for this optimizer when it was read.
            names = parameter_names(optimizer, part.module)
            whole = local_to_whole(optimizer, part.module, names)
            entries = {i: entries[w] for i, w in enumerate(whole) if w in entries}
            groups = local_groups(optimizer, groups)
        state = slice_optimizer_state(entries, params, set(part.parameters), tp, tp_rank)
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_optimizer_count(saved: int, current: int) -> None:
    if saved != current:
        raise CheckpointError(
            f"The checkpoint holds {saved} optimizer states but configure_optimizers returned {current} "
            "optimizers. Resume with the configure_optimizers that saved it, or load the weights only "
            "(LightningModule.load_state_dict on the consolidated checkpoint)."
        )
