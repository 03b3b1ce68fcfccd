"""Save and load a :class:`~lightning_pipe.runtime.ParallelRuntime`'s part of a sharded checkpoint.

A checkpoint is a dictionary as Lightning writes one: ``state_dict`` (the model),
``optimizer_states`` (one per optimizer) and anything else (loop counters, schedulers, a training
script's own state). Here ``state_dict`` and each optimizer's ``state`` hold *this rank's* part,
keyed by the unsharded model's names; :func:`write` makes every rank of the first replica write its
file into one directory, and :func:`read` gives each rank back its own entries, already cut for
the current layout, whatever layout wrote them (:mod:`lightning_pipe.checkpoint`). The strategy
adds Lightning's flow around these; a plain training loop calls
:meth:`ParallelRuntime.save_checkpoint` / :meth:`ParallelRuntime.load_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_pipe.checkpoint.metadata import CheckpointError, CheckpointMetadata, shard_file_name
from lightning_pipe.checkpoint.optimizer_view import local_groups, local_to_whole
from lightning_pipe.checkpoint.reader import ShardedCheckpoint
from lightning_pipe.checkpoint.state import (
    check_keys,
    check_shapes,
    holds_key,
    load_model_shard,
    load_optimizer_shard,
    model_records,
    model_shard,
    optimizer_records,
    optimizer_shard,
    parameter_names,
    shard_of,
    slice_optimizer_state,
)
from lightning_pipe.checkpoint.writer import RankShard, write_sharded_checkpoint

if TYPE_CHECKING:
    from lightning_pipe.runtime.runtime import ParallelRuntime

SHARDED = "pipe_tp_sharded_checkpoint"
"""Marks a checkpoint dictionary read from a sharded directory (its entries are this rank's)."""


def model_state(runtime: ParallelRuntime) -> dict[str, Any]:
    """This rank's part of the model state, keyed by the unsharded model's names."""
    c = runtime.mesh.coordinates
    return model_shard(runtime.module, runtime.plan, runtime.stage_indices, c.tp_rank)


def optimizer_state(runtime: ParallelRuntime, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, keyed by parameter name, with its groups."""
    c = runtime.mesh.coordinates
    logical = runtime.logical(optimizer)
    return optimizer_shard(logical, runtime.module, runtime.plan, runtime.stage_indices, c.tp_rank)


def write(runtime: ParallelRuntime, path: str | Path, checkpoint: dict[str, Any], is_writer: bool) -> None:
    """Collective over the world: write ``checkpoint`` (its ``state_dict`` and optimizer
    ``state`` entries this rank's parts) as the sharded directory ``path``. ``is_writer``: this
    rank writes the rest of the dictionary and the metadata (global rank 0)."""
    c, layout = runtime.mesh.coordinates, runtime.mesh.layout
    tp, module = layout.tensor_parallel_size, runtime.module
    checkpoint = dict(checkpoint)
    model = checkpoint.pop("state_dict")
    optimizers = checkpoint.pop("optimizer_states", None)
    file = shard_file_name(c.pp_rank, c.tp_rank)
    shard = None
    if c.dp_rank == 0:  # the other replicas hold the same values
        shard = RankShard(
            file,
            {"model": model, "optimizers": [o["state"] for o in optimizers or []]},
            model_records(model, module, tp, c.tp_rank, file),
            [optimizer_records(o["state"], module, tp, c.tp_rank, file) for o in optimizers or []],
        )
    if optimizers is not None:
        checkpoint["optimizer_states"] = [{k: v for k, v in o.items() if k != "state"} for o in optimizers]
    header = CheckpointMetadata(
        layout={
            "data_parallel_size": layout.data_parallel_size,
            "pipeline_parallel_size": layout.pipeline_parallel_size,
            "tensor_parallel_size": tp,
        },
        layer_names=list(runtime.plan.layer_names),
        balance=list(runtime.plan.balance),
    )
    write_sharded_checkpoint(
        path,
        shard,
        checkpoint if is_writer else None,
        header if is_writer else None,
        key_order=list(module.state_dict().keys()),
    )


def read(
    runtime: ParallelRuntime,
    path: str | Path,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: bool | None = True,
) -> dict[str, Any]:
    """The checkpoint dictionary at ``path`` with this rank's model entries and, for each of
    ``optimizers``, its state for this rank's parameters, numbered for it and cut for this layout."""
    reader = ShardedCheckpoint(path)
    c, tp = runtime.mesh.coordinates, runtime.mesh.layout.tensor_parallel_size
    checkpoint = reader.lightning_state(weights_only)
    checkpoint["state_dict"] = load_model_shard(
        reader, runtime.module, runtime.plan, runtime.stage_indices, tp, c.tp_rank, strict
    )
    checkpoint[SHARDED] = {"keys": list(reader.metadata.model), "layout": reader.metadata.layout}
    saved = checkpoint.get("optimizer_states")
    if saved is not None and optimizers:
        check_optimizer_count(len(saved), len(optimizers))
        owned = {id(p) for p in runtime.parameters}
        checkpoint["optimizer_states"] = [
            load_optimizer_shard(reader, i, entry, runtime.logical(opt), runtime.module, owned, tp, c.tp_rank)
            for i, (entry, opt) in enumerate(zip(saved, optimizers, strict=True))
        ]
    return checkpoint


def load_model(runtime: ParallelRuntime, checkpoint: dict[str, Any], strict: bool = True) -> None:
    """Load this stage's entries of ``checkpoint`` (from :func:`read`, or an ordinary single-file
    checkpoint, whose full tensors are cut to this rank's slice)."""
    c, tp = runtime.mesh.coordinates, runtime.mesh.layout.tensor_parallel_size
    module, plan = runtime.module, runtime.plan
    current = module.state_dict(keep_vars=True)
    saved = checkpoint["state_dict"]
    sharded = checkpoint.get(SHARDED)
    if strict:
        check_keys(sharded["keys"] if sharded else saved, current, "The checkpoint")
    if not sharded:  # a plain checkpoint holds full tensors (a sharded one was checked on read)
        shapes = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
        check_shapes(shapes, current, tp, "The checkpoint")
    state = {
        k: shard_of(v, current.get(k) if isinstance(current.get(k), torch.Tensor) else None, tp, c.tp_rank)
        for k, v in saved.items()
        if k in current and holds_key(plan, k, runtime.stage_indices)
    }
    module.load_state_dict(state, strict=False)


def load_optimizers(
    runtime: ParallelRuntime, checkpoint: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Load each optimizer's entries for this rank's parameters, cutting full tensors (an
    ordinary checkpoint numbers the whole model's parameters, as one device does)."""
    c, tp = runtime.mesh.coordinates, runtime.mesh.layout.tensor_parallel_size
    owned = {id(p) for p in runtime.parameters}
    check_optimizer_count(len(checkpoint["optimizer_states"]), len(optimizers))
    for optimizer, saved in zip(
        [runtime.logical(o) for o in optimizers], checkpoint["optimizer_states"], strict=True
    ):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        entries, groups = saved["state"], saved["param_groups"]
        if SHARDED not in checkpoint:
            # A sharded checkpoint was numbered for this optimizer when it was read.
            names = parameter_names(optimizer, runtime.module)
            whole = local_to_whole(optimizer, runtime.module, names)
            entries = {i: entries[w] for i, w in enumerate(whole) if w in entries}
            groups = local_groups(optimizer, groups)
        state = slice_optimizer_state(entries, params, owned, tp, c.tp_rank)
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_optimizer_count(saved: int, current: int) -> None:
    if saved != current:
        raise CheckpointError(
            f"The checkpoint holds {saved} optimizer states but configure_optimizers returned {current} "
            "optimizers. Resume with the configure_optimizers that saved it, or load the weights only "
            "(LightningModule.load_state_dict on the consolidated checkpoint)."
        )
