"""Edits of checkpoint files on disk, shared by the checkpoint tests that damage them."""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.metadata import METADATA_FILE


def edit_metadata(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the parsed metadata of the sharded checkpoint ``path`` and write it back."""
    data = json.loads((path / METADATA_FILE).read_text())
    change(data)
    (path / METADATA_FILE).write_text(json.dumps(data))


def drop_checksums(path: Path) -> None:
    """Make ``path``'s metadata what lightning_pipe wrote before it recorded a CRC32 per tensor."""

    def strip(data: dict[str, Any]) -> None:
        for record in data["model"].values():
            record.pop("crc32", None)
        for optimizer in data["optimizers"]:
            for entries in optimizer.values():
                for record in entries.values():
                    record.pop("crc32", None)

    edit_metadata(path, strip)


def _entry_data_offset(file: Path, info: zipfile.ZipInfo) -> int:
    """Where ``info``'s bytes start in ``file`` (after its local header, whose name and extra field
    lengths may differ from the central directory's)."""
    with file.open("rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def xor_bytes(file: Path, offset: int, count: int, mask: int = 0x5A) -> None:
    """XOR ``count`` bytes of ``file`` at ``offset`` with ``mask`` (the file's size unchanged)."""
    with file.open("r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ mask for b in data))


def flip_entry(file: Path, suffix: str, count: int = 1) -> str:
    """XOR ``count`` bytes in the middle of the zip entry of the ``torch.save`` file ``file`` whose
    name ends with ``suffix`` (``/data.pkl``); returns the entry's name."""
    with zipfile.ZipFile(file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    xor_bytes(file, _entry_data_offset(file, info) + info.file_size // 2, count)
    return info.filename


def flip_tensor_bytes(file: Path, where: tuple[Any, ...], count: int = 48) -> str:
    """XOR ``count`` bytes in the middle of the data of the tensor at ``where`` (a path of keys into
    the loaded payload) inside the ``torch.save`` file ``file``, as a failing disk would: the zip
    structure intact, ``torch.load`` loading it without a word. Returns the zip entry's name."""

    def value() -> torch.Tensor:
        node: Any = torch.load(file, map_location="cpu", weights_only=True)
        for step in where:
            node = node[step]
        return node.clone()

    before = value()
    with zipfile.ZipFile(file) as archive:
        storages = [i for i in archive.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
    for info in storages:  # which storage holds the tensor: the one whose change changes it
        n = min(count, info.file_size)
        offset = _entry_data_offset(file, info) + (info.file_size - n) // 2
        xor_bytes(file, offset, n)
        if not torch.equal(value(), before):
            return info.filename
        xor_bytes(file, offset, n)  # back: not this one
    raise AssertionError(f"no storage of {file} holds the tensor at {where}")
