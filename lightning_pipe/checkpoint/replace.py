"""Put a freshly written checkpoint where the previous one was, without ever losing both.

The sharded writer (a directory) and the single-file writer (consolidation, gathered checkpoints)
end the same way: the new checkpoint is complete under a temporary name beside ``path`` and must
take ``path``'s place. Three things make that delicate:

* ``path`` may hold a user's own directory (a typo in ``dirpath``, or ``trainer.save_checkpoint``
  pointed at a data folder). Deleting it would lose work we cannot restore, so only what a save
  may legitimately overwrite is replaced: a file, a symlink, an empty directory, or a sharded
  checkpoint directory. Anything else is refused before any shard is written.
* ``path`` may be a symlink (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` one). The
  link itself is replaced, never the checkpoint it points to.
* A directory cannot be renamed over an existing path atomically, so the previous occupant moves
  to ``.NAME.old`` first; if the second rename fails it moves back, and once the new checkpoint is
  in place a failure to delete ``.NAME.old`` is only a warning: the save itself succeeded. A
  crash between the two renames leaves the previous checkpoint under ``.NAME.old`` only; the next
  save moves it back before anything else, so that save failing too cannot lose it.
* A crash after the new checkpoint was complete but before it took ``path``'s place leaves it,
  complete, under ``.NAME.tmp`` (its metadata, written last, says so) while ``path`` is missing.
  :func:`recover_leftover` puts the newest complete copy back under ``path``; a save calls it before
  clearing ``.NAME.tmp``, and a load calls it when ``path`` is missing, so a completed checkpoint is
  never deleted and resuming finds it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from lightning_pipe.checkpoint.metadata import METADATA_FILE, CheckpointError, is_checkpoint_directory


def remove_path(path: Path) -> None:
    """Delete a file, a symlink (not its target) or a directory tree; nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def discard(path: Path) -> None:
    """Remove a failed save's temporary file or directory; a failure here must not hide the first."""
    try:
        remove_path(path)
    except OSError:
        pass


def recover_leftover(path: Path) -> Path | None:
    """If ``path`` is missing but a crashed save left a complete sharded checkpoint beside it
    (``.NAME.tmp``, the newer, or ``.NAME.old``), move it back to ``path`` and return where it was."""
    if path.is_symlink() or path.exists():
        return None
    for leftover in (path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"):
        if leftover.is_dir() and not leftover.is_symlink() and is_checkpoint_directory(leftover):
            leftover.rename(path)
            warnings.warn(
                f"{path} was missing: a save that crashed between its renames left the complete "
                f"checkpoint {leftover.name}, which is now back under {path.name}.",
                stacklevel=2,
            )
            return leftover
    return None


def check_replaceable(path: Path) -> None:
    """Raise unless a checkpoint save may put its result at ``path``."""
    if path.is_symlink() or not path.exists() or not path.is_dir():
        return
    if is_checkpoint_directory(path) or not any(path.iterdir()):
        return
    raise CheckpointError(
        f"Cannot save a checkpoint to {path}: it is a directory that is not a lightning_pipe checkpoint "
        f"(it has no {METADATA_FILE}), and saving would delete what it holds. Choose another checkpoint "
        "path, or remove that directory yourself if you no longer need it."
    )


def replace_path(new: Path, path: Path) -> None:
    """Move the complete checkpoint ``new`` to ``path``, replacing what was there."""
    check_replaceable(path)  # again: the directory may have changed since the save began
    if new.is_file() and (path.is_symlink() or path.is_file() or not path.exists()):
        os.replace(new, path)  # one atomic step: a crash leaves the old file or the new one
        return
    old = path.parent / f".{path.name}.old"
    present = path.is_symlink() or path.exists()
    if not present and (old.is_symlink() or old.exists()):
        # An earlier save crashed between its two renames: the previous checkpoint is only here.
        # Put it back first, so that it stays safe until this one is in place.
        old.rename(path)
        present = True
    remove_path(old)  # left by an earlier save that crashed after its new checkpoint was in place
    if present:
        path.rename(old)
    try:
        new.rename(path)
    except BaseException:
        if present:
            old.rename(path)
        raise
    if present:
        try:
            remove_path(old)
        except OSError as err:
            warnings.warn(
                f"The checkpoint {path} is saved, but the previous one, moved to {old}, could not be "
                f"deleted ({err}); delete it yourself to free the space.",
                stacklevel=2,
            )
