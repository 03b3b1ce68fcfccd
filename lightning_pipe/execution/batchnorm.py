"""Deferred batch normalisation: running statistics of the whole batch, committed once per batch.

Under micro-batching a ``BatchNorm`` layer sees each micro-batch separately. Left alone it would
update its running statistics once per micro-batch, with each micro-batch's statistics
(``num_batches_tracked`` would grow by ``num_microbatches`` per step), so evaluation would use
statistics no single device ever had. torchgpipe's answer (Kim et al. 2020, "torchgpipe", section
3.3, "deferred batch normalization") is followed here: while a training step runs, the layers
normalise with micro-batch statistics but leave their running statistics alone; the sums of the
inputs and of their squares are accumulated over every micro-batch, and after the step the
running mean, the (unbiased) running variance and ``num_batches_tracked`` are updated once, from
the statistics of the whole batch, exactly as one device would. With data parallelism the sums are
added over the replicas first, since one device would have seen their samples as one batch.

What cannot be made equal: the *training-mode normalisation* of each micro-batch uses that
micro-batch's statistics (the pipeline never has the whole batch in one place), so gradients differ
from one device unless there is one micro-batch per batch. The runtime refuses it at setup unless
the user allows it (``allow_batch_norm_microbatches``), and then warns.

Activation recomputation runs a layer's forward again during backward; those calls must not count
twice, so the executor marks its backward passes with :func:`running_backward`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_backward_depth = 0
"""How many executor backward passes are running (recomputed forwards happen inside them). A
plain counter, not thread-local: autograd may run a CUDA backward on its own device thread."""


@contextmanager
def running_backward() -> Iterator[None]:
    """Mark a backward pass: forwards recomputed inside it do not accumulate statistics."""
    global _backward_depth
    _backward_depth += 1
    try:
        yield
    finally:
        _backward_depth -= 1


def batch_norm_layers(layers: Sequence[nn.Module]) -> list[_BatchNorm]:
    """The BatchNorm modules inside ``layers`` that keep running statistics."""
    found = {
        id(m): m
        for layer in layers
        for m in layer.modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    }
    return list(found.values())


def normalising_by_batch(layers: Sequence[nn.Module]) -> list[_BatchNorm]:
    """Every BatchNorm module inside ``layers`` (with or without running statistics): each one
    normalises a training forward by the statistics of the samples it is given."""
    found = {id(m): m for layer in layers for m in layer.modules() if isinstance(m, _BatchNorm)}
    return list(found.values())


class DeferredBatchNorm:
    """Defers the running-statistics updates of some BatchNorm modules to :meth:`commit`.

    Between :meth:`begin` and :meth:`commit`, each module normalises with the statistics of the
    micro-batch it is given and its running statistics stay untouched; :meth:`commit` applies one
    update from the statistics of everything seen since :meth:`begin`.
    """

    def __init__(self, modules: Sequence[_BatchNorm]) -> None:
        self.modules = list(modules)
        self._active = False
        self._sums: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles = [
            module.register_forward_pre_hook(self._hook(index)) for index, module in enumerate(self.modules)
        ]

    def remove(self) -> None:
        """Remove the hooks (at the end of a Trainer call; the next one installs its own)."""
        self.end()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int) -> Any:
        def accumulate(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._active or not module.training or _backward_depth:
                return
            x = args[0].detach()
            dims = [0, *range(2, x.dim())]
            # float64 sums: the variance from sum and sum of squares then matches one device's
            # two-pass statistics to far below 1e-5.
            x64 = x.double()
            # A fill on the device, not torch.tensor([...], device=...): that copies from the host
            # and, on CUDA, synchronises once per BatchNorm layer per micro-batch (docs/gpu.md F15).
            count = x64.new_full((1,), float(x.numel() // x.shape[1]))
            stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), count])
            current = self._sums[index]
            self._sums[index] = stats if current is None else current + stats

        return accumulate

    def begin(self) -> None:
        """Start a batch: normalise with batch statistics and leave running statistics alone."""
        self._active = True
        self._sums = [None] * len(self.modules)
        for module in self.modules:
            # A training-mode BatchNorm without running-statistics tracking normalises with the
            # input's statistics and updates nothing (not even num_batches_tracked).
            module.track_running_stats = False

    def end(self) -> None:
        """Stop deferring without committing (after a failed step)."""
        self._active = False
        for module in self.modules:
            module.track_running_stats = True

    def commit(self, group: dist.ProcessGroup | None = None) -> None:
        """Update every module's running statistics once, from the whole batch's statistics
        (summed over ``group``, the data-parallel replicas, when given)."""
        self.end()
        sums = self._sums
        self._sums = [None] * len(self.modules)
        if not self.modules:
            return
        if group is not None and dist.get_world_size(group) > 1:
            sizes = [2 * m.num_features + 1 for m in self.modules]
            device = self.modules[0].running_mean.device  # type: ignore[union-attr]
            parts = [
                s if s is not None else torch.zeros(n, dtype=torch.float64, device=device)
                for s, n in zip(sums, sizes, strict=True)
            ]
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=group)
            sums = list(flat.split(sizes))
        for module, stats in zip(self.modules, sums, strict=True):
            if stats is not None and float(stats[-1]) > 0:
                _update(module, stats)


def _update(module: _BatchNorm, stats: torch.Tensor) -> None:
    """One running-statistics update from ``[sum, sum of squares, count]``, as ``F.batch_norm``
    does in training mode on one device."""
    c = module.num_features
    count = float(stats[-1])
    mean = stats[:c] / count
    var = (stats[c : 2 * c] / count - mean * mean).clamp_min(0)
    unbiased = var * (count / (count - 1)) if count > 1 else var
    assert module.running_mean is not None and module.running_var is not None
    assert module.num_batches_tracked is not None
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
        factor = (
            1.0 / float(module.num_batches_tracked) if module.momentum is None else float(module.momentum)
        )
        rm, rv = module.running_mean, module.running_var
        rm.copy_((rm.double() * (1 - factor) + mean.to(rm.device) * factor).to(rm.dtype))
        rv.copy_((rv.double() * (1 - factor) + unbiased.to(rv.device) * factor).to(rv.dtype))
