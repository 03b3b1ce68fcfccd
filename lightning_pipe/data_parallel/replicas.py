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


def carrier_device(group: dist.ProcessGroup) -> torch.device | None:
    """The device a host tensor must travel through on ``group``, or ``None`` when the group's
    backend takes host tensors. NCCL has no CPU backend ("No backend type associated with device
    type cpu"), and setup broadcasts an eagerly built model's tensors while they are still on the
    host (the strategy moves each rank's stage to its device afterwards): docs/gpu.md, F1."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def broadcast_parameters(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    """Copy ``src``'s values of ``tensors`` (parameters and buffers) to every rank of ``group``;
    a host tensor on an NCCL group goes through the rank's device and back."""
    if dist.get_world_size(group) == 1:
        return
    carrier = carrier_device(group)
    for tensor in tensors:
        if carrier is None or tensor.device.type != "cpu":
            dist.broadcast(tensor.data, src=src, group=group)
            continue
        on_device = tensor.data.to(carrier)
        dist.broadcast(on_device, src=src, group=group)
        tensor.data.copy_(on_device)
