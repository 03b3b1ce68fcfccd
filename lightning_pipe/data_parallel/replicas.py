"""Start data-parallel replicas identical: copy the first replica's parameters to the others.

A model built eagerly may be initialised differently per rank (no seed, or a per-rank one);
broadcasting at setup makes the replicas equal by construction (a meta-built model's replicas are
equal already: see :mod:`lightning_pipe.construction.materialize`) (gradients are then averaged by
:mod:`.reducer`, so they stay equal).
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
