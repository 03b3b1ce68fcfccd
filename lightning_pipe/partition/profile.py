"""Measure each pipeline layer's forward and backward time on a sample micro-batch.

``partition="time"`` (torchgpipe's ``balance_by_time``) splits the layers so that the slowest
stage is as fast as it can be, which needs each layer's cost: parameter counts say little about
attention against a feed-forward block, or an embedding against a head. The layers are timed one
at a time, in pipeline order, each on the previous one's output:

* a private copy of the layer is made and moved to the device (built on the meta device, it is
  materialised and filled with small random values: the times do not depend on them), run forward
  and backward a few times, and dropped, so that no rank ever holds more than one layer beyond its
  own stage, and the model's own weights, gradients and BatchNorm statistics are left untouched;
* backward is :func:`torch.autograd.grad` to the layer's input and parameters from a gradient of
  ones, which computes what training computes without accumulating anything;
* the random state is restored afterwards, so that dropout in the profile draws no number the run
  would have drawn (the run stays equal to one device's);
* the warm-up run also counts what autograd saves for backward (the layer's parameters left out:
  they are held anyway) and the bytes of the layer's output, which the layout planner
  (:mod:`lightning_pipe.planning`) needs for activation memory and the messages between stages.

The times are per micro-batch; the runtime has global rank 0 measure them alone and sends them
to every rank, so that every rank computes the same split.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from statistics import median_high
from typing import Any

import torch
from torch import nn

from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.execution.memory import Counted, counting_saved
from lightning_pipe.execution.split_backward import backward_input
from lightning_pipe.skip.scope import SkipScope


@dataclass(frozen=True)
class LayerTime:
    """One layer's measured time per micro-batch, in seconds."""

    forward: float
    backward: float
    saved_bytes: int = 0
    """What autograd saved for backward in the forward (distinct tensors, parameters left out)."""
    output_bytes: int = 0
    """The layer's output (what a stage boundary after it would send)."""
    saved_input_bytes: int = 0
    """Of ``saved_bytes``, the layer's input (the previous layer's output, or the stage's input)."""
    saved_output_bytes: int = 0
    """Of ``saved_bytes``, the layer's own output (an activation function saves its result): with
    ``saved_input_bytes``, what lets a stage's total count a tensor two layers save only once."""
    split_backward_ratio: float = 1.0
    """The backward split into input and weight gradients, as zero-bubble schedules run it
    (:mod:`lightning_pipe.execution.split_backward`: I, then W), over one ordinary backward of the
    same forward (1: not timed). On CPU the split costs more than it saves on small layers:
    ``benchmarks/split_backward.py`` measured 1.09 - 1.57."""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return tuple(_to(v, device) for v in value)
    raise TypeError(
        f"The sample micro-batch for partition='time' must be a tensor or a tuple of tensors (the "
        f"first pipeline layer's input), got {type(value).__name__}."
    )


def _leaves(value: Any) -> Any:
    """``value`` detached, floating tensors requiring grad (the layer input's gradient is timed)."""
    if isinstance(value, tuple):
        return tuple(_leaves(v) for v in value)
    return value.detach().requires_grad_(value.is_floating_point() or value.is_complex())


def _needing_grad(value: Any) -> list[torch.Tensor]:
    """The tensors of a layer's output (backward's roots) or input (what it differentiates) that
    take part in autograd."""
    return [t for t in (value if isinstance(value, tuple) else (value,)) if t.requires_grad]


def _private_copy(layer: nn.Module, device: torch.device) -> nn.Module:
    tensors = itertools.chain(layer.parameters(), layer.buffers())
    twin = copy.deepcopy(layer)
    if any(t.is_meta for t in tensors):
        twin = twin.to_empty(device=device)
        with torch.no_grad():
            for t in itertools.chain(twin.parameters(), twin.buffers()):
                if t.is_floating_point():
                    t.normal_(0.0, 0.02)
                else:
                    t.zero_()
    return twin.to(device).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, tuple):
        return sum(_tensor_bytes(v) for v in value)
    return value.nbytes if isinstance(value, torch.Tensor) else 0


def _activation_bytes(saved: Counted, params: Sequence[torch.Tensor]) -> int:
    """The saved tensors' bytes but the parameters' (and their views', which share the pointer)."""
    held = {p.data_ptr() for p in params}
    return sum(size for (pointer, _), size in saved.items() if pointer not in held)


def _saved_among(saved: Counted, value: Any) -> int:
    """The bytes of ``value``'s tensors that autograd saved (a detached copy shares the pointer)."""
    tensors = value if isinstance(value, tuple) else (value,)
    pointers = {t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)}
    return sum(size for (pointer, _), size in saved.items() if pointer in pointers)


def profile_layers(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    repeats: int = 3,
    split_backward: bool = False,
) -> list[LayerTime]:
    """Time every layer's forward and backward on ``sample`` (one micro-batch's pipeline input):
    the median of ``repeats`` runs after one warm-up run, per layer. ``split_backward``: also time
    the backward split into input and weight gradients against an ordinary one
    (:attr:`LayerTime.split_backward_ratio`; two more forwards and backwards per run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    times: list[LayerTime] = []
    x = _to(sample, device)
    devices = [device] if device.type == "cuda" else []
    # Layers that pop a skip get what an earlier layer stashed (detached: only this layer is timed).
    skips = SkipScope(where="the timing of partition='time'", overwrite=True)
    with torch.random.fork_rng(devices=devices):
        for position, layer in enumerate(layers):
            twin = _private_copy(layer, device)
            params: list[torch.Tensor] = [p for p in twin.parameters() if p.requires_grad]
            forward, backward = [], []
            out: Any = None
            saved: Counted = {}
            counted_input: Any = None
            counted_output: Any = None
            for run in range(repeats + 1):
                inputs = _leaves(x)
                _sync(device)
                start = time.perf_counter()
                try:
                    # The warm-up run counts the saved tensors (the hook costs time: not the timed runs).
                    counting = counting_saved(saved) if run == 0 else nullcontext()
                    with torch.enable_grad(), skips.active(), counting:
                        out = apply_layers([twin], inputs, position)
                    if run == 0:  # kept alive, so that no later tensor reuses their pointers
                        counted_input, counted_output = inputs, out
                except Exception as err:
                    if hasattr(err, "add_note"):  # Python >= 3.11
                        err.add_note(
                            f'partition="time" was timing pipeline layer {position} ({type(layer).__name__}) '
                            "on the sample micro-batch (under Lightning: the first micro-batch of "
                            "example_input_array, which must be a batch of forward's input)."
                        )
                    raise
                _sync(device)
                middle = time.perf_counter()
                roots, wrt = _needing_grad(out), _needing_grad(inputs)
                if roots and wrt + params:
                    torch.autograd.grad(
                        roots, wrt + params, [torch.ones_like(t) for t in roots], allow_unused=True
                    )
                _sync(device)
                if run:  # the first run warms caches and allocators up
                    forward.append(middle - start)
                    backward.append(time.perf_counter() - middle)
            ratio = _split_ratio(twin, params, x, position, skips, device, repeats) if split_backward else 1.0
            times.append(
                LayerTime(
                    median_high(forward),
                    median_high(backward),
                    saved_bytes=_activation_bytes(saved, list(twin.parameters())),
                    output_bytes=_tensor_bytes(out),
                    saved_input_bytes=_saved_among(saved, counted_input),
                    saved_output_bytes=_saved_among(saved, counted_output),
                    split_backward_ratio=ratio,
                )
            )
            x = tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
            skips.popped.update({name: t.detach() for name, t in skips.stashed.items()})
            del twin, params, counted_input, counted_output
    return times


def _split_ratio(
    twin: nn.Module,
    params: Sequence[torch.Tensor],
    x: Any,
    position: int,
    skips: SkipScope,
    device: torch.device,
    repeats: int,
) -> float:
    """The split backward (I then W) over an ordinary one, each after a forward of its own, in
    turns (the medians of ``repeats`` after one warm-up of each). Both accumulate into ``.grad``
    as training does (the private copy's and the detached input's: nothing of the model's)."""
    ordinary: list[float] = []
    split: list[float] = []
    for run in range(2 * (repeats + 1)):
        inputs = _leaves(x)
        with torch.enable_grad(), skips.active():
            out = apply_layers([twin], inputs, position)
        roots, wrt = _needing_grad(out), _needing_grad(inputs)
        if not roots or not (wrt or params):
            return 1.0
        grads = [torch.ones_like(t) for t in roots]
        _sync(device)
        start = time.perf_counter()
        if run % 2:
            backward_input(roots, grads, wrt).run()
        else:
            torch.autograd.backward(roots, grads)
        _sync(device)
        if run >= 2:  # the first of each warms up
            (split if run % 2 else ordinary).append(time.perf_counter() - start)
    base = median_high(ordinary)
    return median_high(split) / base if base > 0 else 1.0
