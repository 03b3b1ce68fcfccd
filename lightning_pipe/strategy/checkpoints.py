"""Checkpoint saving and loading for ``PipeTPStrategy``: Lightning's hooks over the plain-torch
:mod:`lightning_pipe.checkpoint` package.

Lightning asks the strategy for the model's and each optimizer's state (``dump_checkpoint``), then
to write the checkpoint; on resume it asks it to read one and then to load the model and optimizer
state. With the default sharded format the first two return this rank's part only, keyed by the
unsharded module's names, and the write is a collective in which every rank of the first replica
writes its own file. Loading happens after setup (``restore_checkpoint_after_setup``), when the
model is already split and sharded, so each rank reads only its stage's entries and cuts its own
tensor-parallel slice, whatever layout saved them. A plain single-file checkpoint (from one device
or from ``consolidate``) takes the same path: its full tensors are cut the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_pipe.checkpoint.collective import fail_together
from lightning_pipe.checkpoint.consolidate import save_atomically
from lightning_pipe.checkpoint.full import gather_model_state, gather_optimizer_state
from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.checkpoint.replace import recover_leftover, remove_path
from lightning_pipe.checkpoint.state import (
    check_optimizer_cuttable,
)
from lightning_pipe.failures import PeerLostError
from lightning_pipe.runtime import checkpointing
from lightning_pipe.strategy.base import PipeTPParts
from lightning_pipe.strategy.compat import (
    load_checkpoint_file,
    optimizers_to_device,
    weights_only_of_running_call,
)

_SHARDED = "pipe_tp_sharded_checkpoint"  # marks a checkpoint dict read from a sharded directory
_SAVE_JOIN_LIMIT = timedelta(seconds=60)
"""How long the ranks of a save may arrive apart (they reach a save at the same point of the loop)."""


class CheckpointHooks(PipeTPParts):
    """The checkpoint half of ``PipeTPStrategy`` (which provides the mesh, plan and module)."""

    save_distributed_checkpoint: bool = True
    _timeout: timedelta | None

    @contextmanager
    def _together(self, what: str) -> Iterator[None]:
        """:func:`fail_together` (one rank's error raised on every rank), and a lost peer named."""
        with self._lost_peers(what[0].lower() + what[1:]), fail_together(what):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load after the model is split and sharded: each rank then reads only its stage's keys and
        # cuts its own tensor-parallel slices, whatever layout saved the checkpoint.
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model (sharded format), or the whole model on rank 0."""
        # The first call of a save (dump_checkpoint asks for the model first): every rank must be
        # here, or the save's collectives would wait on ranks that are elsewhere.
        self._every_rank_saves()
        if not self.save_distributed_checkpoint:
            with self._collective("gathering the whole model for a single-file checkpoint"):
                return gather_model_state(self.module, self.runtime.plan, self.mesh)
        return checkpointing.model_state(self.runtime)

    def _every_rank_saves(self) -> None:
        """Fail with a message that names the fix when a save runs on some ranks only (the habit
        ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` from other strategies)."""
        if self.world_size == 1 or dist.get_backend() != "gloo":
            return  # monitored_barrier exists for gloo only; NCCL ranks wait for the watchdog
        # Half the deadline: the ranks that are elsewhere (in a collective of their own) must
        # still be waiting when this rank gives up, so that they name it as the first failure.
        limit = min(self._timeout / 2 if self._timeout else _SAVE_JOIN_LIMIT, _SAVE_JOIN_LIMIT)
        try:
            with self._lost_peers("starting to save a checkpoint"):
                dist.monitored_barrier(timeout=limit, wait_all_ranks=True)
        except PeerLostError:
            raise
        except Exception as err:
            cause = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(
                f"Saving a checkpoint on rank {self.global_rank}: not every rank started the save within "
                f"{limit.total_seconds():.0f}s ({cause}). Under pipe_tp, trainer.save_checkpoint is a "
                "collective: call it on every rank (not under `if trainer.is_global_zero:`); each rank "
                "writes its own part."
            ) from err

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state by parameter name (sharded format), or the
        whole optimizer state on rank 0."""
        # Every rank learns whether any rank's state cannot be saved, before the gather or the write.
        with self._together("Saving the optimizer state"):
            if self.save_distributed_checkpoint:
                return checkpointing.optimizer_state(self.runtime, optimizer)
            logical = self.runtime.logical(optimizer)  # sharded: assembled from the replicas
            check_optimizer_cuttable(logical, self.module)
        with self._collective("gathering the optimizer state for a single-file checkpoint"):
            return gather_optimizer_state(logical, self.mesh, self.module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Sharded: every rank of the first replica writes its own file into the directory
        ``filepath`` (see :mod:`lightning_pipe.checkpoint.writer`). Single-file: rank 0 writes."""
        if storage_options is not None:
            raise TypeError(
                "PipeTPStrategy.save_checkpoint(..., storage_options=...) is not supported: the strategy "
                "writes checkpoints itself rather than through a CheckpointIO plugin."
            )
        with self._lost_peers("agreeing on the checkpoint path"):
            path = Path(self.broadcast(str(filepath)))
        if not self.save_distributed_checkpoint:
            with self._together(f"Saving the checkpoint {path}"):  # rank 0 writes; all learn the outcome
                if self.is_global_zero:
                    save_atomically(checkpoint, path)
            return
        with self._collective(f"saving the checkpoint {path}"):
            checkpointing.write(self.runtime, path, checkpoint, self.is_global_zero)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_path(Path(filepath))  # a sharded directory, a file, or a save_last="link" symlink

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory (from any layout): the Lightning state plus this rank's model and
        optimizer entries, already cut for this layout. A file: an ordinary Lightning checkpoint."""
        if weights_only is None:
            # Lightning drops the caller's weights_only for strategies that restore after setup.
            weights_only = weights_only_of_running_call()
        with self._lost_peers("agreeing on the checkpoint path"):
            path = Path(self.broadcast(str(checkpoint_path)))
        with self._together(f"Loading the checkpoint {path}"):
            if self.is_global_zero:  # every rank waits: fail_together is a collective
                recover_leftover(path)  # a save that crashed between its renames
        with self._together(f"Loading the checkpoint {path}"):
            if not path.is_dir():
                return load_checkpoint_file(super().load_checkpoint, path, weights_only)
            strict = self.module.strict_loading
            return checkpointing.read(self.runtime, path, self.optimizers, strict, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's entries, cutting full tensors (a plain checkpoint) to this rank's slice."""
        with self._together("Loading the model weights"):
            checkpointing.load_model(self.runtime, dict(checkpoint), strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this stage's optimizer entries, cutting full tensors to this rank's slice."""
        with self._together("Loading the optimizer state"):
            checkpointing.load_optimizers(self.runtime, dict(checkpoint), self.optimizers)
            optimizers_to_device(self.optimizers, self.root_device)
