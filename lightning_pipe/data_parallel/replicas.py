"""Start replicas identical and average their gradients over the data-parallel group.

This is the plain, correct baseline: one all-reduce per gradient after the whole step's backward.
A bucketed reducer that overlaps backward replaces it for speed; the semantics (average over the
data-parallel group only, parameters without a gradient contribute zeros) stay the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def broadcast_parameters(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    """Copy ``src``'s values of ``tensors`` (parameters and buffers) to every rank of ``group``."""
    if dist.get_world_size(group) == 1:
        return
    for tensor in tensors:
        dist.broadcast(tensor.data, src=src, group=group)


def average_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average ``.grad`` over ``group``; a missing gradient takes part as zeros so no rank waits."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for param in params:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        param.grad.div_(size)
