"""Byte-level text for a Hugging Face causal LM, padded the way Hugging Face collators pad it.

The corpus is the Python standard library's own source (every machine has it, no download), cut
into documents at blank lines: code blocks of different lengths, so that batches carry real
padding. Each document is encoded as its UTF-8 bytes (ids 0-255) after a beginning-of-text id,
cut to ``max_length``; a batch is right-padded with ``pad_id`` to its longest document, with the
``attention_mask`` Hugging Face expects and ``labels`` equal to the ids, ``-100`` on the padding
(the model shifts them by one itself). No tokenizer is needed, so the example runs offline; a real
run would use ``AutoTokenizer`` and ``DataCollatorForLanguageModeling(tokenizer, mlm=False)``,
which produce the same three keys.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

BOS_ID, PAD_ID = 256, 257
VOCAB_SIZE = 264  # 256 bytes, BOS, PAD, rounded up so that tensor-parallel sizes 2, 4, 8 divide it


def documents(max_chars: int, min_chars: int = 40) -> list[str]:
    """Blank-line separated blocks of the stdlib's ``.py`` files, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        for block in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if len(block.strip()) >= min_chars:
                docs.append(block)
                total += len(block)
        if total >= max_chars:
            break
    return docs


class ByteDocuments(Dataset):
    def __init__(self, docs: list[str], max_length: int) -> None:
        self.docs, self.max_length = docs, max_length

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = [BOS_ID, *self.docs[i].encode("utf-8")][: self.max_length]
        return torch.tensor(ids, dtype=torch.long)


def pad_collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on padding)."""
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ByteTextDataModule(L.LightningDataModule):
    def __init__(
        self,
        max_length: int = 128,
        batch_size: int = 16,
        max_chars: int = 1_000_000,
        val_fraction: float = 0.05,
    ) -> None:
        super().__init__()
        self.max_length, self.batch_size = max_length, batch_size
        self.max_chars, self.val_fraction = max_chars, val_fraction

    def setup(self, stage: str) -> None:
        docs = documents(self.max_chars)
        cut = int(len(docs) * (1 - self.val_fraction))
        self.train_set = ByteDocuments(docs[:cut], self.max_length)
        self.val_set = ByteDocuments(docs[cut:], self.max_length)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=pad_collate
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True, collate_fn=pad_collate)
