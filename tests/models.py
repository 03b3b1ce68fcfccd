"""Tiny networks shared by the tests: small enough for 2 CPU cores, rich enough to catch bugs.

``TupleNet`` passes a tuple between layers with a float tensor that carries gradients, a float
tensor that does not (a sinusoidal position table, as rotary tables travel in real models) and a
boolean mask, and it accepts any sequence length, so one network exercises every transport path.
"""

from __future__ import annotations

import math

import torch
from torch import nn

IN_FEATURES = 6
HIDDEN = 12
OUT_FEATURES = 3


def position_table(seq_len: int, dim: int) -> torch.Tensor:
    pos = torch.arange(seq_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(100.0) / dim))
    table = torch.zeros(seq_len, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Embed(nn.Module):
    """x [b, s, in] -> (h [b, s, d], pos [s, d] without grad, mask [b, s] bool)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN_FEATURES, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = x[..., 0] > -1.0
        return self.proj(x), position_table(x.shape[1], HIDDEN), mask


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(
        self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        update = torch.tanh(self.fc(h + pos)) * mask[..., None].to(h.dtype)
        return h + update, pos, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(h).mean(dim=1)


def tuple_net(seed: int = 0) -> nn.Sequential:
    """Eight layers: Embed, six Blocks, Head."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), *[Block() for _ in range(6)], Head())


def make_batch(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, IN_FEATURES, generator=g), torch.randn(batch, OUT_FEATURES, generator=g)
