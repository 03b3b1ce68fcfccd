"""A column-parallel linear layer under sequence parallelism that saves this rank's part of the
sequence for its backward, not the whole sequence it multiplied.

A column layer multiplies the whole sequence (all-gathered from the ranks' parts), and a plain
``F.linear`` would save that whole input for the weight's gradient: the very activation sequence
parallelism exists to split. Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
(Korthikanti et al., 2022, section 4.2.2) saves the part instead and all-gathers it again in
backward; :func:`sequence_parallel_linear` does the same, which is what brings the activations
between the regions to 1/tp of their size (the whole input of the attention's and the MLP's first
layers is most of what a block saves there).

Two ways the whole sequence reaches a column layer:

* the layer gathers its input itself (``sequence_input="shard"``: an MLP's first layer): it
  all-gathers, multiplies, and in backward reduce-scatters its input's gradient (partial over the
  ranks' columns) to this rank's part;
* an enclosing ``sequence_gather`` module gathered it once for all its layers (attention: its
  projections, and whatever else in it reads the shape of the whole sequence):
  :func:`gather_for_module` tags the whole sequence with this rank's part, and each column layer
  that receives the tagged tensor saves the part. Its input gradient goes back through the
  module's gather, whose backward reduce-scatters (:attr:`GatheredGradient.MIXED`: a column layer
  sends ``size`` times its partial gradient, so that anything else in the module that consumed the
  whole sequence, with gradients equal on every rank, still sums right); no all-reduce.

The layers that share one gathered input (query, key and value projections) share one re-gather
in backward too: the first to need it gathers, the last to use it lets it go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_pipe.tensor_parallel.regions import (
    GatheredGradient,
    all_gather_sequence,
    copy_to_region,
    gather_from_sequence,
    start_all_gather_sequence,
    start_reduce_scatter_sequence,
)

_PART = "_lightning_pipe_sequence_part"
"""The attribute of a gathered whole sequence that holds its :class:`SequencePart`."""


class SharedRegather:
    """The second gather of one gathered sequence, shared by the column layers that consumed it:
    the first whose backward needs it starts it, the last lets it go. It holds no activation of
    its own (the part comes from each layer's saved tensors), so that what autograd keeps, and
    what recomputation frees, is decided by the saved tensors alone."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._users = 0
        self._whole: Callable[[], torch.Tensor] | None = None

    def use(self) -> None:
        """One more layer will need the whole sequence again in its backward."""
        self._users += 1

    def regathered(self, part: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The whole sequence again (``part`` as saved), started by the first layer that asks,
        waited for by the call returned, and released after the last layer's use."""
        if self._whole is None:
            self._whole = start_all_gather_sequence(part, self.group, "sequence_all_gather_recompute")
        whole = self._whole
        self.release()
        return whole

    def release(self) -> None:
        """One layer's use of the whole sequence is over (after the last, it is let go)."""
        self._users -= 1
        if self._users <= 0:
            self._whole = None


class SequencePart:
    """This rank's part of a sequence that a module gathered, kept on the whole sequence (for the
    forward only: it dies with the whole) so that the column layers consuming the whole can save
    the part instead, and share its re-gather."""

    def __init__(self, part: torch.Tensor, whole: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.part = part
        self.shared = SharedRegather(group)
        # Changed in place after the gather, the two would no longer agree: then not used.
        self._versions = (part._version, whole._version)

    def matches(self, whole: torch.Tensor) -> bool:
        """Whether ``whole`` is still the gather of the part (neither changed in place)."""
        return (self.part._version, whole._version) == self._versions


def gather_for_module(part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence for a ``sequence_gather`` module whose column layers compute tensor
    parallel inside it: tagged with ``part``; backward reduce-scatters (see the module docstring)."""
    whole = gather_from_sequence(part, group, GatheredGradient.MIXED)
    if whole is not part:  # more than one rank
        setattr(whole, _PART, SequencePart(part, whole, group))
    return whole


def sequence_part_of(whole: torch.Tensor) -> SequencePart | None:
    """The part ``whole`` was gathered from, if :func:`gather_for_module` made it and it is
    unchanged."""
    tag = getattr(whole, _PART, None)
    return tag if isinstance(tag, SequencePart) and tag.matches(whole) else None


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear`` over the whole sequence that saves this rank's part of it (the module docstring).

    Inputs: the whole sequence when a module gathered it (``None``: gather ``part`` here), this
    rank's part, the weight, the bias, the group, the re-gather it shares with its siblings (or
    ``None``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        whole: torch.Tensor | None,
        part: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        shared: SharedRegather | None,
    ) -> torch.Tensor:
        ctx.group, ctx.shared, ctx.gathered, ctx.has_bias = group, shared, whole is not None, bias is not None
        # The backward runs under the forward's autocast, as torch.amp.custom_bwd would: the
        # re-gathered input and the weight are cast as they were for the forward's product.
        ctx.autocast = _autocast_state(part.device.type)
        if whole is None:
            whole = all_gather_sequence(part, group, "sequence_all_gather_forward")
        if shared is not None:
            shared.use()
        ctx.save_for_backward(part, weight)
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        part, weight = ctx.saved_tensors
        needs_input = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        device_type, enabled, dtype = ctx.autocast
        grad_input = grad_weight = grad_bias = None
        whole: Callable[[], torch.Tensor] | None = None
        # Megatron's order: the part's all-gather travels while the input gradient is computed, and
        # the input gradient's reduce-scatter while the weight gradient is.
        if ctx.needs_input_grad[2]:
            whole = (
                ctx.shared.regathered(part)
                if ctx.shared is not None
                else start_all_gather_sequence(part, ctx.group, "sequence_all_gather_recompute")
            )
        elif ctx.shared is not None:
            ctx.shared.release()  # this layer's use is over
        reduced: Callable[[], torch.Tensor] | None = None
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if needs_input:
                grad_input = grad.matmul(weight).to(part.dtype)
                if ctx.gathered:  # through the module's gather, which divides the sum by the size
                    grad_input = grad_input * dist.get_world_size(ctx.group)
                else:
                    reduced = start_reduce_scatter_sequence(
                        grad_input, ctx.group, "sequence_reduce_scatter_backward"
                    )
            if whole is not None:
                grad_weight = grad.flatten(0, -2).t().matmul(whole().flatten(0, -2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.flatten(0, -2).sum(0)
        if reduced is not None:
            return None, reduced(), grad_weight, grad_bias, None, None
        return grad_input, None, grad_weight, grad_bias, None, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup, gathered: bool
) -> torch.Tensor:
    """A column-parallel layer's product under sequence parallelism.

    ``gathered``: ``x`` is the whole sequence an enclosing module gathered; otherwise ``x`` is this
    rank's part, gathered here.
    """
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight, bias)
    if not gathered:
        return _SequenceParallelLinear.apply(None, x, weight, bias, group, None)
    tag = sequence_part_of(x)
    if tag is None:
        # Not the tensor the module gathered (made from it, a cast or a view, or from elsewhere):
        # plain tensor parallelism, whose ``f`` makes the gradient equal on every rank, which the
        # module's gather sums right too; the whole input is saved and an all-reduce paid.
        return F.linear(copy_to_region(x, group), weight, bias)
    return _SequenceParallelLinear.apply(x, tag.part, weight, bias, group, tag.shared)
