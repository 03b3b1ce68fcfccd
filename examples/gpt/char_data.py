"""Character-level text from the Python standard library's own source: on every machine, no download.

The corpus is the concatenation of the stdlib's ``.py`` files in sorted order (so every process and
every machine with the same Python reads the same text), cut to ``max_chars``. Characters are the
printable ASCII range plus newline and tab; anything else maps to ``?``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

ALPHABET = "\n\t" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(ALPHABET)
_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}
_UNKNOWN = _INDEX["?"]


def stdlib_text(max_chars: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    return torch.tensor([_INDEX.get(ch, _UNKNOWN) for ch in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(ALPHABET[i] for i in ids.tolist())


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` characters: input ``[:-1]``, target ``[1:]``."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    def __init__(
        self, seq_len: int = 64, batch_size: int = 32, max_chars: int = 2_000_000, val_fraction: float = 0.05
    ):
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.max_chars, self.val_fraction = max_chars, val_fraction

    def setup(self, stage: str) -> None:
        ids = encode(stdlib_text(self.max_chars))
        cut = int(len(ids) * (1 - self.val_fraction))
        self.train_set = Windows(ids[:cut], self.seq_len)
        self.val_set = Windows(ids[cut:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)
