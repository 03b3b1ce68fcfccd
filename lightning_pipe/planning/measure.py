"""Measure what the cost model needs, on one device, without building the whole model there.

* Time and activation bytes per layer: the layer profiler of ``partition="time"``
  (:func:`~lightning_pipe.partition.profile.profile_layers`), which copies one layer at a time to
  the device (materialising a meta-built one with random values), so a model too large for the
  device is still measured. It runs twice, on micro-batches of ``rows`` and ``2 x rows`` samples:
  the difference is the part that grows with the micro-batch, the rest the fixed part (launches,
  Python, reading the weights) that makes many small micro-batches slower than few large ones.
  A layer's time is not that line everywhere (on CPU the time per sample grows once a layer's
  activations leave the caches: a 4-stage pipeline of one 16-sample micro-batch ran 1.5x what the
  line from 2 and 4 samples predicted), so the layers are also timed at the micro-batch sizes the
  candidates run (:func:`measurement_sizes`: a few, spread over them, the largest always), and the
  model reads each size from its nearest measurements. Each size is timed in several rounds
  (:data:`MEASURED_ROUNDS`), taking turns, and each layer's time is the median over the rounds: one
  profile lasts a fraction of a second, and on a shared host one in a few lands in a stretch where
  other work takes the cores (the Llama of ``benchmarks/auto_layout.py``, its inputs measured six
  times in a row, about ten seconds each: its forward summed 20 - 28 ms, once 56 ms, and the same
  layout's prediction moved by up to 2x).
* Parameter bytes per layer: from the parameters' shapes and dtypes, so a meta-built model
  (:mod:`~lightning_pipe.construction.meta`) costs nothing to count.
* What tensor parallelism splits: the model's plan, resolved and checked by the same function the
  runtime uses (:func:`~lightning_pipe.tensor_parallel.plan.resolve_plan`), which also decides
  which tensor sizes the model accepts (heads and split dimensions divisible).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import median_high
from typing import Any

import torch
from torch import nn

from lightning_pipe.partition.profile import LayerTime, profile_layers
from lightning_pipe.planning.costs import LayerCost, ModelCosts
from lightning_pipe.tensor_parallel.plan import resolve_plan
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle

_FORWARD_REDUCING = frozenset(
    {TensorParallelStyle.ROWWISE, TensorParallelStyle.ROWWISE_SPLIT, TensorParallelStyle.VOCAB}
)
"""Styles whose module all-reduces its output in forward (the column styles reduce the input's
gradient in backward)."""


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s distinct parameters (meta ones included: shapes and dtypes suffice)."""
    distinct = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in distinct)


@dataclass(frozen=True)
class LayerSplit:
    """What the tensor-parallel plan does inside one pipeline layer."""

    parameter_bytes: int = 0
    forward_collectives: int = 0
    backward_collectives: int = 0


def plan_splits(
    model: nn.Module, layers: Sequence[nn.Module], resolved: Mapping[str, TensorParallelStyle]
) -> list[LayerSplit]:
    """Per layer of ``layers`` (modules inside ``model``), the split parameters and collectives of
    the plan ``resolved`` (module name in ``model`` -> style)."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for module in layer.modules():
            owner.setdefault(id(module), index)
    bytes_ = [0] * len(layers)
    forward = [0] * len(layers)
    backward = [0] * len(layers)
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if id(module) not in owner:
            continue  # outside the pipeline's layers (a module only the model's forward uses)
        index = owner[id(module)]
        if style.is_column or style in _FORWARD_REDUCING:
            bytes_[index] += parameter_bytes(module)
        forward[index] += style in _FORWARD_REDUCING
        backward[index] += style.is_column
    return [LayerSplit(b, f, k) for b, f, k in zip(bytes_, forward, backward, strict=True)]


def accepted_tensor_sizes(
    model: nn.Module,
    layers: Sequence[nn.Module],
    plan_for: Callable[[int], Mapping[str, str] | None],
    world: int,
) -> tuple[frozenset[int], dict[int, list[LayerSplit]]]:
    """The tensor sizes dividing ``world`` that the model's plan accepts (``plan_for(t)`` returns
    the plan for ``t`` ranks, ``None`` for a model without one, or raises for a size it refuses),
    and per accepted size > 1 what it splits in each of ``layers``. Each size is checked by
    :func:`resolve_plan`, the runtime's own check, so the planner never proposes a size that
    setup would refuse."""
    sizes = {1}
    splits: dict[int, list[LayerSplit]] = {}
    for t in range(2, world + 1):
        if world % t:
            continue
        try:
            plan = plan_for(t)
            if not plan:
                break  # no plan: tensor parallelism is not available at any size
            resolved = resolve_plan(model, plan, t)
        except (ValueError, TypeError):
            continue  # a dimension or head count ``t`` does not divide
        sizes.add(t)
        splits[t] = plan_splits(model, layers, resolved)
    return frozenset(sizes), splits


def _fixed(small: float, large: float) -> float:
    """The part of a time measured at ``rows`` (``small``) and ``2 rows`` (``large``) that does not
    scale: ``2 small - large``, kept within ``[0, small]`` (timing noise can push it outside)."""
    return min(max(2 * small - large, 0.0), small)


MEASURED_SIZES = 5
"""At most this many micro-batch sizes are timed per layer (the measured rows and twice them
included): the time to measure grows with the samples timed, and the line between two measured
sizes is close enough in between."""


def measurement_sizes(needed: Iterable[int], rows: int, limit: int = MEASURED_SIZES) -> list[int]:
    """The micro-batch sizes to time besides ``rows`` and ``2 rows`` (always timed: their
    difference gives the fixed part) among the sizes the candidates run (``needed``): all of
    them when they are few, else ``limit - 2`` picked at even steps through their sorted list (the
    candidates' sizes are mostly powers of two, so that is about even in their logarithm), the
    largest always (the slowest per sample, and the farthest from a line through small sizes),
    the smallest too when two or more are picked."""
    others = sorted({int(r) for r in needed if r >= 1} - {rows, 2 * rows})
    room = max(0, limit - 2)
    if len(others) <= room:
        return others
    if room == 0:
        return []
    if room == 1:
        return [others[-1]]
    step = (len(others) - 1) / (room - 1)
    return sorted({others[round(i * step)] for i in range(room)})


MEASURED_ROUNDS = 3
"""Rounds of the layer profile at every size, the median kept (see the module docstring): three
rounds outvote one spoiled round, at three times a profile's time (the Llama of
``benchmarks/auto_layout.py`` at its five sizes: about 3 seconds a round on CPU)."""


def measure_layers(
    layers: Sequence[nn.Module],
    sample_at: Callable[[int], Any],
    rows: int,
    device: torch.device,
    splits: Sequence[LayerSplit] | None = None,
    repeats: int = 3,
    sizes: Iterable[int] = (),
    split_backward: bool = True,
    rounds: int = MEASURED_ROUNDS,
) -> list[LayerCost]:
    """Every layer's cost per micro-batch of ``rows`` samples (``sample_at(r)``: the first layer's
    input for ``r`` samples), timed also at twice the rows and at ``sizes`` (the micro-batch sizes
    the candidates run; :func:`measurement_sizes` picks them); ``splits``: what a tensor-parallel
    plan splits per layer; ``split_backward``: time the split backward's ratio too, at ``rows``
    (where some candidate is zero-bubble: :func:`~.candidates.splits_backward`); ``rounds``: the
    sizes profiled in turn this many times, each layer's time the median over the rounds."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}.")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    timed = sorted({rows, 2 * rows, *sizes})
    profiles: dict[int, list[list[LayerTime]]] = {r: [] for r in timed}
    for _ in range(rounds):
        # In turns, so that a stretch of the host's other work spoils one round of each size at
        # most; the split backward's ratio at the measured rows only (zero-bubble candidates pay it).
        for r in timed:
            with_split = split_backward and r == rows
            profiles[r].append(
                profile_layers(layers, sample_at(r), device, repeats, split_backward=with_split)
            )
    medians = {r: _median_profile(runs) for r, runs in profiles.items()}
    small, large = medians[rows], medians[2 * rows]
    extra = {r: t for r, t in medians.items() if r != rows}
    splits = list(splits) if splits is not None else [LayerSplit()] * len(layers)
    costs = []
    for index, (layer, a, b, split) in enumerate(zip(layers, small, large, splits, strict=True)):
        costs.append(
            LayerCost(
                forward_seconds=a.forward,
                backward_seconds=a.backward,
                forward_fixed_seconds=_fixed(a.forward, b.forward),
                backward_fixed_seconds=_fixed(a.backward, b.backward),
                timings=tuple((r, t[index].forward, t[index].backward) for r, t in sorted(extra.items())),
                activation_bytes=a.saved_bytes,
                output_bytes=a.output_bytes,
                saved_input_bytes=a.saved_input_bytes,
                saved_output_bytes=a.saved_output_bytes,
                parameter_bytes=parameter_bytes(layer),
                parameter_tensors=len({id(p) for p in layer.parameters() if p.requires_grad}),
                split_parameter_bytes=min(split.parameter_bytes, parameter_bytes(layer)),
                tensor_forward_collectives=split.forward_collectives,
                tensor_backward_collectives=split.backward_collectives,
                split_backward_ratio=a.split_backward_ratio,
            )
        )
    return costs


def _median_profile(runs: Sequence[Sequence[LayerTime]]) -> list[LayerTime]:
    """Per layer, the median of ``runs``' times (each a profile of every layer); the bytes, the
    same in every run, from the first."""
    return [
        replace(
            times[0],
            forward=median_high(t.forward for t in times),
            backward=median_high(t.backward for t in times),
            split_backward_ratio=median_high(t.split_backward_ratio for t in times),
        )
        for times in zip(*runs, strict=True)
    ]


OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the run's optimizer over some parameters, e.g. :func:`adamw`."""


def adamw(parameters: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW with its defaults: the optimizer a plan assumes when the run's is not known yet (its
    two state tensors per parameter are the memory's default ``optimizer_state_factor``)."""
    return torch.optim.AdamW(parameters)


def optimizer_seconds(
    layer: nn.Module, optimizer: OptimizerFactory, device: torch.device, repeats: int = 3
) -> float:
    """One step of ``optimizer`` over tensors shaped like ``layer``'s parameters (meta ones
    included: zeros of their shapes are stepped, one layer at a time on the device), the median of
    ``repeats`` after a first step that creates the state."""
    shapes = [(p.shape, p.dtype) for p in {id(p): p for p in layer.parameters()}.values() if p.requires_grad]
    if not shapes:
        return 0.0
    params = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for shape, dtype in shapes]
    return _step_seconds(params, optimizer, device, repeats)


def _step_seconds(
    params: list[torch.Tensor], optimizer: OptimizerFactory, device: torch.device, repeats: int
) -> float:
    """The median of ``repeats`` steps of ``optimizer`` over ``params`` (zero gradients given),
    after a first step that creates the state."""
    for p in params:
        p.grad = torch.zeros_like(p)
    step = optimizer(params)
    times = []
    for run in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if run:  # the first creates the state
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (a tensor or a tuple of them)."""
    if isinstance(value, tuple | list):
        return sum(tensor_bytes(v) for v in value)
    return value.nbytes if isinstance(value, torch.Tensor) else 0


def measure_model(
    layers: Sequence[nn.Module],
    sample_at: Callable[[int], Any],
    rows: int,
    device: torch.device,
    splits: Sequence[LayerSplit] | None = None,
    repeats: int = 3,
    optimizer_state_factor: float = 2.0,
    optimizer: OptimizerFactory | None = None,
    sizes: Iterable[int] = (),
    sharded: bool = True,
    split_backward: bool = True,
    rounds: int = MEASURED_ROUNDS,
) -> ModelCosts:
    """:func:`measure_layers` (``sizes``: the further micro-batch sizes timed), with the first
    layer's input and the optimizer's bytes: what the cost model needs of a model. With
    ``optimizer`` (the run's, as a factory), its step is timed per layer too
    (:func:`optimizer_seconds`), and, where ``sharded`` (some candidate shards its parameters with
    FSDP2: :func:`~.candidates.shards_parameters`), its DTensor overhead
    (:func:`sharded_step_overhead`, about a second: not paid where no candidate can use it);
    ``split_backward``, ``rounds``: as :func:`measure_layers` takes them."""
    costs = measure_layers(layers, sample_at, rows, device, splits, repeats, sizes, split_backward, rounds)
    if optimizer is not None:
        costs = [
            replace(cost, optimizer_seconds=optimizer_seconds(layer, optimizer, device, repeats))
            for cost, layer in zip(costs, layers, strict=True)
        ]
    return ModelCosts(
        tuple(costs),
        rows,
        input_bytes=tensor_bytes(sample_at(rows)),
        optimizer_state_factor=optimizer_state_factor,
        sharded_step_seconds=(
            sharded_step_overhead(optimizer, device, repeats=repeats) if optimizer and sharded else 0.0
        ),
    )


def sharded_step_overhead(
    optimizer: OptimizerFactory, device: torch.device, tensors: int = 32, numel: int = 256, repeats: int = 3
) -> float:
    """Per parameter tensor, what a step of ``optimizer`` over DTensors takes beyond the same step
    over plain tensors (FSDP2 steps its sharded parameters as DTensors, and DTensor dispatches
    every operation of the step for each tensor: on CPU about 0.3 ms a tensor, several times
    AdamW's own time on a small layer). Timed on this process alone: ``tensors`` small tensors
    (``numel`` elements: the dispatch, not the arithmetic, is timed), wrapped as DTensors sharded
    over a one-process mesh that needs no process group (its elementwise operations communicate
    nothing), the median of ``repeats`` steps each way after a first that creates the state.
    0.0 (not measured) where this torch has no public DTensor or cannot build a mesh without a
    process group (``_init_backend`` and ``_rank`` are private arguments of ``DeviceMesh``)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        # No process group: the planner measures on one rank (or none is started); a one-process
        # mesh is only the DTensors' frame, never used to communicate.
        mesh = DeviceMesh(device.type, [0], _init_backend=False, _rank=0)
    except (ImportError, TypeError):
        return 0.0

    def step_seconds(wrap: Callable[[torch.Tensor], torch.Tensor]) -> float:
        params = [nn.Parameter(wrap(torch.zeros(numel, device=device))) for _ in range(tensors)]
        return _step_seconds(list(params), optimizer, device, repeats)

    plain = step_seconds(lambda t: t)
    sharded = step_seconds(lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False))
    return max(0.0, sharded - plain) / tensors


def compute_slots(device: torch.device, world: int, threads: int | None = None) -> float | None:
    """How many of ``world`` processes on this host can compute at once at the speed their layers
    were measured at: on CPU, the host's cores over the threads each process uses (``threads``,
    default ``torch.get_num_threads()``), at most ``world``; ``None`` on an accelerator (a device
    per process)."""
    if device.type != "cpu":
        return None
    cores = os.cpu_count() or 1
    return float(min(world, max(1.0, cores / (threads or torch.get_num_threads()))))


def device_memory(device: torch.device) -> int | None:
    """The bytes free on a CUDA device; ``None`` elsewhere (the user must say: ``--memory``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return None
