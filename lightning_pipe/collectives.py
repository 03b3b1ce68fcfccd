"""Collectives whose names changed across the torch versions the package supports.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` and made the old names emit a
``FutureWarning`` on every call; torch 2.4, the oldest the package declares, has only the old
names. Every flat-buffer gather and scatter of the engine goes through here, so the engine uses
the current name where it exists and never warns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """Every rank's ``input`` concatenated into ``output`` (``world_size`` times its size)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """This rank's equal slice of ``input`` reduced over ``group``, into ``output``."""
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
