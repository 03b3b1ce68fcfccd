"""Megatron-style sharded layers, built by slicing a full layer's weights.

Each layer keeps only its rank's slice of the weight and marks every sharded parameter with the
dim it was split along (``param.tensor_parallel_dim``), which is how gradient clipping counts
replicated parameters once and checkpoints reassemble full tensors. Slicing a full, seeded layer
(rather than initialising shards independently) is what makes a sharded model start from exactly
the weights of its single-device twin.

* :class:`ColumnParallelLinear`: output features split (weight rows); input replicated, entering
  through ``f``; output sharded, or gathered with ``gather_output=True``.
* :class:`RowParallelLinear`: input features split (weight columns); input already sharded (or
  scattered with ``input_is_parallel=False``); partial outputs summed by ``g``; the bias, which is
  replicated, is added once after the sum.
* :class:`VocabParallelEmbedding`: vocabulary rows split; ids outside this rank's range are looked
  up as row 0 and zeroed, then ``g`` sums the ranks' rows, exactly one of which is non-zero.

Their ``forward`` runs eagerly under ``torch.compile`` (:mod:`~.eager`): a compiled
block's graph stops before each and resumes after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.tensor_parallel.eager import eager_under_compile
from lightning_pipe.tensor_parallel.regions import (
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    sequence_active,
)
from lightning_pipe.tensor_parallel.sequence_linear import sequence_parallel_linear


def slice_range(size: int, group: dist.ProcessGroup, what: str) -> tuple[int, int]:
    """``[start, end)`` of this rank's equal slice of ``size``, or a clear error if it does not divide."""
    tp = dist.get_world_size(group)
    if size % tp != 0:
        raise ValueError(
            f"{what} is {size}, which tensor_parallel_size={tp} does not divide: each tensor rank "
            f"needs an equal slice. Choose a tensor size that divides {size}, or resize the layer."
        )
    part = size // tp
    rank = dist.get_rank(group)
    return rank * part, (rank + 1) * part


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.tensor_parallel_dim = dim  # type: ignore[attr-defined]
    return param


def _sliced(full: torch.Tensor, part: torch.Tensor) -> nn.Parameter:
    """A parameter holding a copy of ``part`` of the parameter ``full``, trainable or frozen as
    ``full`` is (a frozen base layer under a LoRA adapter stays frozen once sliced)."""
    return nn.Parameter(part.detach().clone(), requires_grad=full.requires_grad)


def tensor_parallel_dim(param: torch.Tensor) -> int | None:
    """The dim ``param`` is sharded along across the tensor group, or ``None`` if replicated."""
    return getattr(param, "tensor_parallel_dim", None)


@eager_under_compile("forward")
class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split across ``group``."""

    def __init__(
        self, linear: nn.Linear, group: dist.ProcessGroup, gather_output: bool = False, name: str = ""
    ) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        start, end = slice_range(
            linear.out_features, group, f"The output features of {name or 'a colwise Linear'}"
        )
        self.in_features, self.out_features = linear.in_features, end - start
        self.weight = _mark(_sliced(linear.weight, linear.weight[start:end]), 0)
        self.bias = (
            _mark(_sliced(linear.bias, linear.bias[start:end]), 0) if linear.bias is not None else None
        )

    sequence_input: str = "none"
    """Under sequence parallelism: ``"shard"``, the input holds this rank's part of the sequence
    and is all-gathered here (instead of ``f``; backward reduce-scatters the partial gradients);
    ``"gathered"``, an enclosing ``sequence_gather`` module gathered it; either way only this rank's
    part is saved for backward (:mod:`~lightning_pipe.tensor_parallel.sequence_linear`), except
    for an input made from the gathered sequence inside the module (a cast, a norm), which is
    saved whole and gets ``f``. ``"none"``: no sequence parallelism."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_input != "none" and sequence_active():
            y = sequence_parallel_linear(
                x, self.weight, self.bias, self.group, gathered=self.sequence_input == "gathered"
            )
        else:  # the whole sequence on every rank: no sequence parallelism, or a check's probe
            y = F.linear(copy_to_region(x, self.group), self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        local = f"in_features={self.in_features}, out_features={self.out_features} (local)"
        sequence = f", sequence_input={self.sequence_input}" if self.sequence_input != "none" else ""
        return f"{local}, gather_output={self.gather_output}{sequence}"


@eager_under_compile("forward")
class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split across ``group``."""

    def __init__(
        self, linear: nn.Linear, group: dist.ProcessGroup, input_is_parallel: bool = True, name: str = ""
    ) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        start, end = slice_range(
            linear.in_features, group, f"The input features of {name or 'a rowwise Linear'}"
        )
        self.in_features, self.out_features = end - start, linear.out_features
        self.weight = _mark(_sliced(linear.weight, linear.weight[:, start:end]), 1)
        self.bias = _sliced(linear.bias, linear.bias) if linear.bias is not None else None

    sequence_output: bool = False
    """Under sequence parallelism: the partial outputs are summed and split along the sequence at
    once (a reduce-scatter instead of ``g``); the bias, added to each rank's part, then gets a
    gradient from that part only, which the runtime sums over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = F.linear(x, self.weight)
        y = (
            reduce_scatter_to_sequence(y, self.group)
            if self.sequence_output and sequence_active()
            else reduce_from_region(y, self.group)
        )
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        sequence = ", sequence_output=True" if self.sequence_output else ""
        return f"in_features={self.in_features} (local), out_features={self.out_features}{sequence}"


@eager_under_compile("forward")
class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its vocabulary (rows) split across ``group``.

    A ``padding_idx`` is kept (its row gets no gradient, on the rank that holds it), and so is the
    scale of an embedding that multiplies its rows by an ``embed_scale`` (Gemma's scaled word
    embedding): slicing must not change what the layer computes. Another subclass that overrides
    ``forward`` is refused: its extra computation would be lost.
    """

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, name: str = "") -> None:
        super().__init__()
        what = name or "The embedding"
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError(
                f"{what} uses max_norm or sparse gradients, which the vocab-parallel embedding does not "
                "support; remove them or leave this layer unsharded."
            )
        scale = getattr(embedding, "embed_scale", None)
        if type(embedding).forward is not nn.Embedding.forward and scale is None:
            raise ValueError(
                f"{what} is a {type(embedding).__name__}, whose own forward the vocab-parallel embedding "
                "would replace (and lose); leave this layer out of the tensor-parallel plan (it stays "
                "whole on every tensor rank)."
            )
        self.group = group
        self.start, self.end = slice_range(
            embedding.num_embeddings, group, f"The vocabulary of {name or 'an Embedding'}"
        )
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = _mark(_sliced(embedding.weight, embedding.weight[self.start : self.end]), 0)
        self.embed_scale: torch.Tensor | None
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None if scale is None else torch.tensor(float(scale))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        pad = self.padding_idx
        local_pad = pad - self.start if pad is not None and self.start <= pad < self.end else None
        rows = F.embedding(local, self.weight, padding_idx=local_pad)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_output and sequence_active():
            rows = reduce_scatter_to_sequence(rows, self.group)
        else:
            rows = reduce_from_region(rows, self.group)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(device=rows.device, dtype=self.weight.dtype)
        return rows

    sequence_output: bool = False
    """Under sequence parallelism, where the sequence is split right after this embedding: the
    ranks' rows are summed and split along the sequence at once (a reduce-scatter instead of ``g``,
    Megatron's ``reduce_scatter_embeddings``)."""

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        rows = f"rows [{self.start}, {self.end}) on this rank"
        return f"{self.num_embeddings}, {self.embedding_dim}, {rows}{pad}"


def gather_slices(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's slice along ``dim`` (for checkpoints and tests)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
