"""Context parallelism in a runtime: each batch cut to this rank's part of its sequences, the
context shard its schedule runs under, the check that attention went through the ring, and the
loss made the whole sequence's.

With ``context_parallel_size = C > 1`` (the mesh's context axis, :mod:`lightning_pipe.mesh`) the
``C`` ranks of a context group hold the same samples. Before anything else, each one cuts the
batch to its chunks of every sequence (:mod:`lightning_pipe.context.chunks`: the model's own cut
from its hooks, or every tensor whose dim 1 is the sequence), so the micro-batches, their loss
items (the chunk's predicted tokens) and the batch agreement all see the rank's part. The loss
weighting is then exact as it is over data replicas: each micro-batch's loss (a mean over its
chunk's tokens) is weighted by its items times the data size over the global batch's items, and
the reduction averages over the data axis (which holds the context ranks), so the gradient is the
whole global batch's token mean, as on one device. That needs the items counted: a batch without
them is refused (a mean of the chunks' means is not the sequence's mean). The schedule runs under
a :class:`~lightning_pipe.context.ContextShard` of the context group and the rank's positions
(ring attention and :func:`~lightning_pipe.context.token_positions` read it).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.batches.microbatch import map_tensors, tensors_of
from lightning_pipe.context import (
    ContextParallelError,
    ContextShard,
    chunk_indices,
    context_shard,
    ring_calls,
    shard_sequence,
)
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import ParallelMesh
from lightning_pipe.runtime.hooks import ModelHooks


class ContextRun:
    """This rank's place in its context group and what a batch needs under it (see the module
    docstring)."""

    def __init__(self, mesh: ParallelMesh, hooks: ModelHooks, pipeline_input: Callable[[Any], Any]) -> None:
        layout = mesh.layout
        self.mesh, self.hooks, self.pipeline_input = mesh, hooks, pipeline_input
        self.size = layout.context_parallel_size
        self.rank = layout.cp_rank(mesh.rank)
        self.group = mesh.context_group
        self.checked = False
        self.calls_before = ring_calls()  # the process's count: other runtimes may have called it

    @classmethod
    def of(
        cls, mesh: ParallelMesh, hooks: ModelHooks, pipeline_input: Callable[[Any], Any]
    ) -> ContextRun | None:
        """The context run of a mesh with a context axis; ``None`` without one. Makes the model's
        attention ring attention (the hooks' ``replace_attention``) once."""
        if mesh.layout.context_parallel_size == 1:
            return None
        if hooks.replace_attention is not None:
            hooks.replace_attention()
        return cls(mesh, hooks, pipeline_input)

    def cut(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """This rank's part of ``batch`` and the global positions of its tokens."""
        if self.hooks.cut_sequence is not None:
            return self.hooks.cut_sequence(batch, self.rank, self.size)
        probe = next(iter(tensors_of(self.pipeline_input(batch))), None)
        if probe is None or probe.dim() < 2:
            raise ContextParallelError(
                f"context_parallel_size={self.size} cuts each sequence along dim 1 of the pipeline input, "
                f"but this batch's pipeline input has "
                f"{'no tensor' if probe is None else f'shape {tuple(probe.shape)}'}: give the first layer "
                "a [batch, tokens, ...] tensor."
            )
        seq_len = probe.shape[1]
        positions = chunk_indices(seq_len, self.rank, self.size)  # refuses a length not divisible by 2C

        def cut(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, 1, self.rank, self.size) if t.dim() >= 2 and t.shape[1] == seq_len else t

        return map_tensors(batch, cut), positions.to(probe.device)

    def scope(self, positions: torch.Tensor) -> AbstractContextManager[ContextShard]:
        """The shard a batch's schedule runs under (forwards, backwards, recomputation)."""
        return context_shard(ContextShard(self.group, positions))

    def check_items(self, counted: bool, training: bool) -> None:
        """Refuse training with losses weighted by samples: each rank's loss is a mean over its
        chunk, and a mean of the chunks' means is not the sequence's."""
        if training and not counted:
            raise ContextParallelError(
                f"context_parallel_size={self.size}: each rank's loss is a mean over its part of the "
                "sequences, which equals one device's only when weighted by token counts, and this batch "
                "gives none. Give a Hugging Face model's batch its 'labels' (or 'shift_labels'), or define "
                "loss_items(batch) (per sample, the tokens the loss averages over; under context "
                "parallelism it is given this rank's part of the batch)."
            )

    def check_attention(self, naming: CollectiveNaming) -> None:
        """On the first training batch: refuse a model whose attention did not go through the
        ring on any rank of the replica (it attended within each rank's part only), before the
        gradients are applied."""
        if self.checked:
            return
        self.checked = True
        calls = torch.tensor([ring_calls() - self.calls_before], dtype=torch.int64)
        with naming("counting ring attention calls over the model replica"):
            dist.all_reduce(calls, group=self.mesh.host_group())
        if int(calls) == 0:
            raise ContextParallelError(
                f"context_parallel_size={self.size}, but no layer of the model called ring attention in its "
                "first training batch: pipe_tp found no attention to replace, so each rank would attend only "
                "within its part of the sequence. A hand-written model calls "
                "lightning_pipe.context.ring_attention(q, k, v) where it computes attention; a Hugging Face "
                "family must compute attention through transformers' attention interface. Or use "
                "context_parallel_size=1."
            )

    def whole_loss(self, loss: torch.Tensor, items: float) -> torch.Tensor:
        """The batch's loss over the whole sequences: each rank's (the mean over its ``items``
        tokens) weighted by its tokens, summed over the context group, on the device."""
        both = torch.stack([loss * items, loss.new_tensor(items)])
        dist.all_reduce(both, group=self.group)
        return both[0] / both[1].clamp_min(1)
