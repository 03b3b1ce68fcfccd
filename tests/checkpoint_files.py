"""Edits of checkpoint files on disk, shared by the checkpoint tests that damage them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_pipe.checkpoint.metadata import METADATA_FILE


def edit_metadata(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the parsed metadata of the sharded checkpoint ``path`` and write it back."""
    data = json.loads((path / METADATA_FILE).read_text())
    change(data)
    (path / METADATA_FILE).write_text(json.dumps(data))
