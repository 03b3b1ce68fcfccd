"""Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file.

The result is what ``strategy="auto"`` on one device would have saved: ``state_dict`` holds every
key of the unsharded LightningModule (so ``load_state_dict(..., strict=True)`` and
``LightningModule.load_from_checkpoint`` work), ``optimizer_states`` are numbered by parameter
position as ``torch.optim`` numbers them, and the loops, callbacks, schedulers and hyper-parameters
are unchanged, so a single-device ``Trainer.fit(ckpt_path=...)`` resumes from it. It runs offline,
in one process, without torch.distributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.durable import disk_full_text, save_durably, sync_directory
from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.replace import check_replaceable, discard, remove_path, replace_path

# Keys a Lightning checkpoint saved with weights_only=True does not have.
_TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")


def consolidate_checkpoint(
    path: str | Path, output: str | Path | None = None, weights_only: bool = False, trust_pickle: bool = False
) -> dict[str, Any]:
    """Read the sharded checkpoint at ``path``; return the single-file checkpoint dictionary and,
    given ``output``, write it there (to a temporary name first, then renamed into place).

    ``weights_only=True`` leaves out the optimizer, scheduler and callback states (for inference).
    ``trust_pickle=True`` reads the Lightning state with ``torch.load(weights_only=False)``, which
    hyper-parameters or callback states holding arbitrary objects need; it can run code stored in
    the file, so use it only for checkpoints you trust. Shard files are always read safely.
    """
    if output is not None:
        check_replaceable(Path(output))  # before the (long) read, not after it
    reader = CheckpointDirectory(path)
    reader.check_complete()  # no model to check the keys against: the files are the reference
    checkpoint = reader.lightning_state(weights_only=not trust_pickle)
    checkpoint["state_dict"] = {key: _copy(reader.model_value(key)) for key in reader.metadata.model}
    if weights_only:
        for key in _TRAINING_STATE_KEYS:
            checkpoint.pop(key, None)
    else:
        optimizer_states = []
        for index, saved in enumerate(checkpoint.get("optimizer_states", [])):
            names = saved["param_names"]
            records = reader.metadata.optimizers[index] if index < len(reader.metadata.optimizers) else {}
            state = {
                position: {k: _copy(reader.optimizer_value(index, name, k)) for k in records[name]}
                for position, name in enumerate(names)
                if name in records
            }
            optimizer_states.append({"state": state, "param_groups": saved["param_groups"]})
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = optimizer_states
    if output is not None:
        save_atomically(checkpoint, output)
    return checkpoint


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def save_atomically(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``.NAME.tmp`` beside ``path``, then put it in place (see
    :mod:`~lightning_pipe.checkpoint.replace`): a crash leaves the previous checkpoint, and a
    directory that is not a checkpoint is refused before anything is written."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        remove_path(tmp)
        try:
            save_durably(obj, tmp)
        except Exception as err:
            full = disk_full_text(err, tmp)
            if full is None:
                raise
            raise CheckpointError(f"Saving the checkpoint {path} failed: {full}") from err
        replace_path(tmp, path)
        sync_directory(path.parent)
    finally:
        discard(tmp)  # there only after a failure
