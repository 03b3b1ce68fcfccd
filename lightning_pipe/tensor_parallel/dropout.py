"""Dropout inside a tensor-parallel region, with its own random stream per tensor rank.

Activations inside a region (attention probabilities of this rank's heads, say) are different
data on each tensor rank, so their dropout masks must differ; activations outside regions are
replicated, so their masks must be equal on every tensor rank, which the default generator gives
because every tensor rank runs the same operations from the same seed. Megatron-LM keeps a second
generator for the regions (its model-parallel RNG tracker); :class:`RegionDropout` does the same
with a private ``torch.Generator`` seeded ``seed + 2718 + tp_rank``, so runs are reproducible and
the default stream is left untouched.

Activation recomputation would replay the default stream but not this one, so the strategy
refuses ``checkpoint`` together with region dropout.
"""

from __future__ import annotations

import torch
from torch import nn

SEED_OFFSET = 2718


class RegionDropout(nn.Module):
    """``nn.Dropout`` drawing its mask from a per-tensor-rank generator."""

    def __init__(self, p: float, seed: int, tp_rank: int, device: torch.device) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + SEED_OFFSET + tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, per-tensor-rank generator"
