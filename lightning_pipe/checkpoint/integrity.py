"""Integrity of the bytes a checkpoint holds: a CRC32 per saved tensor, and the zip entries' own.

``torch.load`` reads a file's tensors without checking them: a few flipped bits inside a tensor's
data (a failing disk, a bad copy) load silently as wrong weights. Two checks close that:

* When a checkpoint directory is written, every tensor's bytes get a CRC32 (:func:`tensor_crc32`),
  recorded per shard file in the metadata (:attr:`TensorEntry.crc32
  <lightning_pipe.checkpoint.metadata.TensorEntry>`); each read of a value recomputes it on the
  bytes read, so a rank that reads a few tensors of a file checks exactly those, nothing more.
* ``torch.save`` writes a zip whose entries carry a CRC32 (zip's own), which ``torch.load`` does
  not compare. :func:`check_zip_entries` compares them: the pickle of every shard file opened (the
  non-tensor values and how each tensor is laid out: small), all of ``lightning_state.pt``, and
  every entry of a shard file that a checkpoint written before the per-tensor checksums holds (so
  those still load, checked as a whole file instead).
"""

from __future__ import annotations

import ctypes
import zipfile
import zlib
from pathlib import Path

import torch

_CHUNK = 1 << 24


def tensor_crc32(value: torch.Tensor) -> int | None:
    """The CRC32 of ``value``'s elements' bytes in row-major order (independent of its strides and
    storage offset, hence the same before saving and after loading); ``None`` for a tensor whose
    bytes are not plain memory (sparse, quantized, meta, a tensor subclass such as a DTensor shard:
    savers hand plain tensors, gathered whole)."""
    data = value.detach()
    if type(data) is not torch.Tensor or data.layout != torch.strided or data.is_quantized or data.is_meta:
        return None
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    size = data.numel() * data.element_size()
    if size == 0:
        return zlib.crc32(b"")
    # A view of the tensor's memory (no copy, no numpy): ``data`` stays alive for the call.
    buffer = (ctypes.c_ubyte * size).from_address(data.data_ptr())
    return zlib.crc32(buffer)


class DamagedZipEntryError(Exception):
    """An entry of a ``torch.save`` file whose bytes do not match the CRC32 its zip records."""

    def __init__(self, entry: str) -> None:
        super().__init__(entry)
        self.entry = entry


def check_zip_entries(path: Path, storages: bool) -> None:
    """Read the entries of the ``torch.save`` file ``path`` and compare each with its zip CRC32:
    all of them (``storages``), or all but the tensors' data (``<archive>/data/<n>``).

    Raises :class:`DamagedZipEntryError` naming the first entry that differs; ``zipfile`` errors for a
    file that is not a zip. A CRC32 of 0 is "not recorded" (``torch.serialization.
    set_crc32_options(False)`` writes files so), never a mismatch.
    """
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.CRC == 0 or (not storages and _is_storage(info.filename)):
                continue
            try:
                with archive.open(info) as entry:  # compares the CRC32 when it reaches the end
                    while entry.read(_CHUNK):
                        pass
            except zipfile.BadZipFile as err:
                if "CRC" not in str(err):
                    raise
                raise DamagedZipEntryError(info.filename) from err


def _is_storage(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 3 and parts[1] == "data"
