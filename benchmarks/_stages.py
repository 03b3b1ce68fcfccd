"""Stage modules shared by the benchmarks: fixed-time (sleeping) layers and a small MLP.

A :class:`FixedTimeLayer` takes exactly ``forward_time`` seconds in forward and ``backward_time``
in backward (a custom autograd function), without using the CPU while it waits, so four ranks on a
two-core machine behave like four devices: any time above the schedule's ideal is the engine's
(scheduling, Python, communication), not the model's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

_overshoot: float | None = None


def sleep_overshoot() -> float:
    """Median time ``time.sleep`` oversleeps in this process (measured once, ~0.1 ms on Linux)."""
    global _overshoot
    if _overshoot is None:
        late = []
        for _ in range(15):
            start = time.perf_counter()
            time.sleep(0.002)
            late.append(time.perf_counter() - start - 0.002)
        _overshoot = max(0.0, sorted(late)[len(late) // 2])
    return _overshoot


def precise_sleep(seconds: float) -> None:
    """Sleep ``seconds`` on average: ``time.sleep`` shortened by its measured overshoot.

    No spinning: on a machine with fewer cores than ranks a spinning rank would steal the core a
    waking rank needs (measured: spinning the last 0.3 ms made steps ~5% slower than this).
    """
    time.sleep(max(0.0, seconds - sleep_overshoot()))


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward`` seconds in forward and ``backward`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:
        if forward > 0:
            precise_sleep(forward)
        ctx.backward = backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        precise_sleep(ctx.backward)
        return grad, None, None


class FixedTimeLayer(nn.Module):
    """``x * w`` that takes ``forward_time`` s forward and ``backward_time`` s backward: half of it
    for the input's gradient, half for the weight's, so that a zero-bubble schedule's input- and
    weight-gradient passes (I and W) take ``backward_time / 2`` each, as the simulator assumes."""

    def __init__(self, forward_time: float, backward_time: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_time, self.backward_time = forward_time, backward_time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.backward_time / 2
        return _Sleep.apply(x, self.forward_time, half) * _Sleep.apply(self.weight, 0.0, half)


def square_loss(output: Any, microbatch: int) -> torch.Tensor:
    """A pipeline head: the mean square of the last stage's (tensor) output."""
    return output.pow(2).mean()


def mlp_layers(width: int, depth: int, seed: int = 0) -> list[nn.Module]:
    """``depth`` blocks of ``Linear(width, width)`` + ``GELU``, built identically on every rank."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.GELU()))
    return layers
