"""Checkpoint saving and loading for ``PipeTPStrategy``: Lightning's hooks over the plain-torch
:mod:`lightning_pipe.checkpoint` package.

Lightning asks the strategy for the model's and each optimizer's state (``dump_checkpoint``), then
to write the checkpoint; on resume it asks it to read one and then to load the model and optimizer
state. With the default format (a checkpoint directory) the first two return this rank's part
only, keyed by the unsliced module's names, and the write is a collective in which every rank of
the first replica writes its own file. Loading happens after setup
(``restore_checkpoint_after_setup``), when the model is already split and sliced, so each rank
reads only its stage's entries and cuts its own tensor-parallel slice, whatever layout saved them.
A plain single-file checkpoint (from one device or from ``consolidate``) takes the same path: its
full tensors are cut the same way.

Each function receives what it needs (the runtime, the mesh, the naming of collectives); the
strategy's hooks call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.checkpoint import rank_state
from lightning_pipe.checkpoint.collective import fail_together
from lightning_pipe.checkpoint.full import gather_model_state, gather_optimizer_state
from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.checkpoint.replace import recover_leftover
from lightning_pipe.checkpoint.single_file import save_atomically
from lightning_pipe.checkpoint.state import check_optimizer_cuttable
from lightning_pipe.faults.board import PeerLostError
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.runtime import ParallelRuntime
from lightning_pipe.strategy.compat import load_checkpoint_file, optimizers_to_device

_SAVE_JOIN_LIMIT = timedelta(seconds=60)
"""How long the ranks of a save may arrive apart (they reach a save at the same point of the loop)."""


@contextmanager
def together(naming: CollectiveNaming, what: str) -> Iterator[None]:
    """:func:`fail_together` (one rank's error raised on every rank), and a lost peer named."""
    with naming.lost_peers(what[0].lower() + what[1:]), fail_together(what):
        yield


def every_rank_saves(naming: CollectiveNaming, rank: int, timeout: timedelta | None) -> None:
    """Fail with a message that names the fix when a save runs on some ranks only (the habit
    ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` from other strategies)."""
    if dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return  # monitored_barrier exists for gloo only; NCCL ranks wait for the watchdog
    # Half the deadline: the ranks that are elsewhere (in a collective of their own) must
    # still be waiting when this rank gives up, so that they name it as the first failure.
    limit = min(timeout / 2 if timeout else _SAVE_JOIN_LIMIT, _SAVE_JOIN_LIMIT)
    try:
        with naming.lost_peers("starting to save a checkpoint"):
            dist.monitored_barrier(timeout=limit, wait_all_ranks=True)
    except PeerLostError:
        raise
    except Exception as err:
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"Saving a checkpoint on rank {rank}: not every rank started the save within "
            f"{limit.total_seconds():.0f}s ({cause}). Under pipe_tp, trainer.save_checkpoint is a "
            "collective: call it on every rank (not under `if trainer.is_global_zero:`); each rank "
            "writes its own part."
        ) from err


def model_state(runtime: ParallelRuntime, distributed: bool, naming: CollectiveNaming) -> dict[str, Any]:
    """This rank's part of the model (``distributed``), or the whole model on rank 0."""
    if not distributed:
        with naming("gathering the whole model for a single-file checkpoint"):
            return gather_model_state(runtime.module, runtime.partition, runtime.mesh)
    return rank_state.model_state(runtime.part)


def optimizer_state(
    runtime: ParallelRuntime, optimizer: Any, distributed: bool, naming: CollectiveNaming
) -> dict[str, Any]:
    """This rank's part of the optimizer state by parameter name (``distributed``), or the whole
    optimizer state on rank 0."""
    # Every rank learns whether any rank's state cannot be saved, before the gather or the write.
    with together(naming, "Saving the optimizer state"):
        # ZeRO-1: assembled from the replicas; shard_parameters: gathered over the data axis.
        view = runtime.logical(optimizer, whole_everywhere=not distributed)
        if distributed:
            return rank_state.optimizer_state(runtime.part, view)
        check_optimizer_cuttable(view, runtime.module)
    with naming("gathering the optimizer state for a single-file checkpoint"):
        return gather_optimizer_state(view, runtime.mesh, runtime.module)


def save(
    runtime: ParallelRuntime,
    checkpoint: dict[str, Any],
    path: Path,
    distributed: bool,
    naming: CollectiveNaming,
) -> None:
    """Distributed: every rank of the first replica writes its own file into the directory
    ``path`` (see :mod:`lightning_pipe.checkpoint.writer`). Single-file: rank 0 writes."""
    if not distributed:
        with together(naming, f"Saving the checkpoint {path}"):  # rank 0 writes; all learn the outcome
            if runtime.mesh.rank == 0:
                save_atomically(checkpoint, path)
        return
    with naming(f"saving the checkpoint {path}"):
        rank_state.write(runtime.part, path, checkpoint)


def load(
    runtime: ParallelRuntime,
    path: Path,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
    load_file: Callable[..., dict[str, Any]],
    naming: CollectiveNaming,
) -> dict[str, Any]:
    """A checkpoint directory (from any layout): the Lightning state plus this rank's model and
    optimizer entries, already cut for this layout. A file: an ordinary Lightning checkpoint,
    read by ``load_file`` (Lightning's own loader)."""
    with together(naming, f"Loading the checkpoint {path}"):
        if runtime.mesh.rank == 0:  # every rank waits: fail_together is a collective
            recover_leftover(path)  # a save that crashed between its renames
    with together(naming, f"Loading the checkpoint {path}"):
        if not path.is_dir():
            return load_checkpoint_file(load_file, path, weights_only)
        views = [runtime.logical(o) for o in optimizers]
        return rank_state.read(runtime.part, path, views, strict, weights_only)


def load_model(
    runtime: ParallelRuntime, checkpoint: Mapping[str, Any], strict: bool, naming: CollectiveNaming
) -> None:
    """Load this stage's entries, cutting full tensors (a plain checkpoint) to this rank's slice."""
    with together(naming, "Loading the model weights"):
        rank_state.load_model(runtime.part, dict(checkpoint), strict)


def load_optimizers(
    runtime: ParallelRuntime,
    checkpoint: Mapping[str, Any],
    optimizers: Sequence[torch.optim.Optimizer],
    naming: CollectiveNaming,
) -> None:
    """Load this stage's optimizer entries, cutting full tensors to this rank's slice."""
    with together(naming, "Loading the optimizer state"):
        views = [runtime.logical(o) for o in optimizers]
        rank_state.load_optimizers(runtime.part, dict(checkpoint), views)
        optimizers_to_device(list(optimizers), runtime.device)
