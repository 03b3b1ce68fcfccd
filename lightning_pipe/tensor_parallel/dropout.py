"""Dropout inside a tensor-parallel region, with its own random stream per tensor rank.

Activations inside a region (attention probabilities of this rank's heads, say) are different
data on each tensor rank, so their dropout masks must differ; activations outside regions are
replicated, so their masks must be equal on every tensor rank, which the default generator gives
because every tensor rank runs the same operations from the same seed. Megatron-LM keeps a second
generator for the regions (its model-parallel RNG tracker); :class:`RegionDropout` does the same
with a ``torch.Generator`` seeded ``seed + 2718 + tp_rank`` (:class:`RegionStream`), so runs are
reproducible and the default stream is left untouched. All region dropouts of a rank draw from
*one* such generator, in call order, as Megatron's tracker does: a generator per module, all
seeded alike, would give every layer the same masks.

Activation recomputation would replay the default stream but not this one, so the strategy
refuses ``checkpoint`` together with region dropout.

Under sequence parallelism the activations between regions are this rank's part of the sequence:
different data per rank again, but masks that must equal one device's. :class:`SequenceDropout`
draws the mask of the *whole* sequence from the default generator, exactly as ``nn.Dropout``
would on the whole tensor (same shape, same generator, same draws on every tensor rank), and keeps
this rank's part: each rank applies a different mask, their concatenation is one device's, and
recomputation replays it (the default stream is the one torch's checkpoint restores). Under
layer-seeded dropout (:mod:`lightning_pipe.execution.seeding`, on with sequence parallelism) that
default stream starts from the layer's own seed, so the masks are also the same whatever the
pipeline split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.tensor_parallel.regions import SEQUENCE_DIM, sequence_active

SEED_OFFSET = 2718


class RegionStream:
    """The random stream of one tensor rank's region dropouts, shared by all of them.

    The generator is made on the device of the first activation it drops (the model may still be
    on the CPU when it is sharded, and a CUDA tensor needs a CUDA generator)."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed + SEED_OFFSET + tp_rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]


class RegionDropout(nn.Module):
    """``nn.Dropout`` drawing its mask from this tensor rank's :class:`RegionStream`."""

    def __init__(self, p: float, stream: RegionStream) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        generator = self.stream.generator(x.device)
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, per-tensor-rank stream"


class _Masked(torch.autograd.Function):
    """``x * scale`` for a dropout's scaled mask (``0`` or ``factor``), saving the mask as booleans
    for backward, as ``nn.Dropout`` does (a float copy would be 4 times the bytes), and computing
    the gradient as it does: ``grad * mask * factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        ctx.save_for_backward(scale.ne(0))  # a new tensor: the whole mask is not kept alive
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (kept,) = ctx.saved_tensors
        return grad * kept * ctx.factor, None, None


class SequenceDropout(nn.Module):
    """``nn.Dropout`` on this rank's part of the sequence, with its part of the whole sequence's
    mask (see the module docstring)."""

    def __init__(self, p: float, group: dist.ProcessGroup) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.group = group
        self._factors: dict[torch.dtype, float] = {}

    def _factor(self, dtype: torch.dtype) -> float:
        """1 / (1 - p) as the mask holds it, rounded to ``dtype`` (on the CPU nn.Dropout's backward
        multiplies by it too; CUDA's fused kernel uses the float factor, a difference within
        bfloat16's rounding); worked out once per dtype, not per call."""
        if dtype not in self._factors:
            self._factors[dtype] = torch.ones((), dtype=dtype).div_(1.0 - self.p).item()
        return self._factors[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not sequence_active():  # the whole sequence (a check's probe): nn.Dropout's own draw
            return F.dropout(x, self.p, True)
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        shape = list(x.shape)
        part = shape[SEQUENCE_DIM]
        shape[SEQUENCE_DIM] *= size
        # F.dropout of ones is the kept mask already scaled by 1 / (1 - p): the factor nn.Dropout
        # multiplies the input by, drawn as nn.Dropout draws it on the whole tensor.
        scale = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), self.p, True)
        return _Masked.apply(x, scale.narrow(SEQUENCE_DIM, rank * part, part), self._factor(x.dtype))

    def extra_repr(self) -> str:
        return f"p={self.p}, this rank's part of the whole sequence's mask"
