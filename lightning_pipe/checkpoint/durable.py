"""Writes that survive a power loss, and a full disk reported as a full disk.

A rename is atomic, but not durable by itself: after a crash the file system may hold the new
name pointing at data that never reached the disk, so a truncated checkpoint could replace a good
one. Every file of a checkpoint is therefore flushed to the disk (``fsync``) before the rename that
publishes it, and so are the directories whose entries change (POSIX needs both).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

_FULL = (errno.ENOSPC, errno.EDQUOT)


def save_durably(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``, then flush the file to the disk."""
    with open(path, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def write_text_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def sync_directory(path: Path) -> None:
    """Flush a directory's entries (new, renamed or removed names) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full_text(err: BaseException, path: Path) -> str | None:
    """A message for a write that failed because the disk or the quota is full, else ``None``.

    torch's zip writer reports a short write as ``unexpected pos N vs M`` rather than ``ENOSPC``.
    """
    full = isinstance(err, OSError) and err.errno in _FULL
    if not full and "unexpected pos" not in str(err):
        return None
    try:
        free = f"{shutil.disk_usage(path if path.exists() else path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return (
        f"the disk or the quota holding {path} is full ({free}; the write failed with: {err}). Free "
        "some space or save the checkpoints elsewhere; the previous checkpoint is untouched."
    )
