"""``layout="auto"``: the layout chosen in the real process group, the same on every rank.

What the Lightning strategy (or a plain-torch loop that builds its mesh afterwards) calls before
the model is split or materialised:

* the constraints are checked first, on every rank alike (no collective: a constraint no layout
  meets is refused the same everywhere, before anything is measured);
* the links are probed in the real group (:func:`~.links.probe_links`, every rank takes part);
* global rank 0 alone measures the layers (:func:`~.measure.measure_model`: one layer at a time on
  its device, a meta-built layer materialised in a private copy, so nothing of the model itself
  is allocated) and ranks the candidates; the others wait, so that no rank skews its timings;
* rank 0's plan (or its error) is broadcast, so that every rank reaches the same decision, and a
  refusal is raised on every rank, not only on the one that measured.

The batch a Lightning replica gets is fixed by its dataloader: a layout with ``dp`` replicas steps
on ``dp`` times the samples of one. Layouts are therefore compared per sample: every predicted
time is given per :attr:`ranked plan <lightning_pipe.planning.Plan.batch>` samples of one replica
(a step of ``dp = 1``; a layout with ``dp`` replicas has its step time divided by ``dp``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.layers import bind_layers
from lightning_pipe.planning.candidates import (
    Candidate,
    Constraints,
    ModelShape,
    divisors,
    enumerate_candidates,
    microbatch_rows,
    shards_parameters,
    splits_backward,
)
from lightning_pipe.planning.cores import probe_collective_wait, probe_compute_slots
from lightning_pipe.planning.cost_model import Prediction
from lightning_pipe.planning.costs import GB, Links, Machine, ModelCosts, format_bytes
from lightning_pipe.planning.links import median_links, probe_links
from lightning_pipe.planning.measure import (
    LayerSplit,
    OptimizerFactory,
    adamw,
    measure_model,
    measurement_sizes,
)
from lightning_pipe.planning.planner import Plan, plan_layout, ranked
from lightning_pipe.planning.report import render
from lightning_pipe.skip.plan import SkipLayers

_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": GB,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}


def parse_memory(value: int | float | str, bare_unit: float = 1.0) -> float:
    """``max_memory`` in bytes: a number of bytes, or a string such as ``"4GB"``, ``"512MiB"``
    (decimal ``kB``/``MB``/``GB``/``TB`` and binary ``KiB``/``MiB``/``GiB``/``TiB``; a bare number
    counts ``bare_unit`` bytes: one here, a gigabyte for ``python -m lightning_pipe.plan --memory``)."""
    if isinstance(value, bool):
        raise ValueError(f"max_memory must be a number of bytes or a string like '4GB', got {value!r}.")
    if isinstance(value, int | float):
        nbytes = float(value) * bare_unit
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_memory must be a number of bytes or a string like '4GB', '512MiB', got {value!r}."
            )
        nbytes = float(match.group(1)) * (_UNITS[unit] if unit else bare_unit)
    if not nbytes > 0:
        raise ValueError(f"max_memory must be a positive amount of memory, got {value!r}.")
    return nbytes


def measured_layers(layers: Sequence[nn.Module], layer_calls: Any = None) -> list[nn.Module]:
    """The pipeline layers as the executor calls them (skip connections and the model's own
    layer calls included): what the profiler runs one after the other."""
    inner, skips = SkipLayers.of(layers)
    return list(skips.wrap(bind_layers(inner, layer_calls)))


def _per_sample(p: Prediction, dp: int) -> Prediction:
    """``p``'s times per step of one replica's samples (a layout with ``dp`` replicas trains ``dp``
    times as many samples in its step): every ``*_seconds`` field, so that the parts still add up
    to the step."""
    times = [f.name for f in dataclasses.fields(Prediction) if f.name.endswith("_seconds")]
    return dataclasses.replace(p, **{name: getattr(p, name) / dp for name in times})


def plan_replica_batch(
    costs: ModelCosts, machine: Machine, shape: ModelShape, replica_batch: int, constraints: Constraints
) -> Plan:
    """Every candidate for ``replica_batch`` samples per data-parallel replica (the global batch of
    a layout is ``replica_batch x dp``), its times per ``replica_batch`` samples, ranked."""
    predictions: list[Prediction] = []
    for batch, _ in _per_data_size(machine.world_size, shape, replica_batch, constraints):
        dp = batch // replica_batch
        plan = plan_layout(
            costs, machine, shape, batch, dataclasses.replace(constraints, data_parallel_size=dp)
        )
        predictions += [_per_sample(p, dp) for p in plan.predictions]
    return ranked(predictions, machine.memory_bytes, replica_batch)


def _data_sizes(world: int, constraints: Constraints) -> list[int]:
    fixed = constraints.data_parallel_size
    return [fixed] if fixed is not None else divisors(world)


def _per_data_size(
    world: int, shape: ModelShape, replica_batch: int, constraints: Constraints
) -> Iterator[tuple[int, list[Candidate]]]:
    """For each data-parallel size with a layout meeting ``constraints``: its global batch
    (``replica_batch x dp``) and its candidates."""
    for dp in _data_sizes(world, constraints):
        batch = replica_batch * dp
        try:
            found = enumerate_candidates(
                world, shape, batch, dataclasses.replace(constraints, data_parallel_size=dp)
            )
        except ValueError:
            continue  # no layout with this data size meets the constraints
        yield batch, found


def needed_rows(world: int, shape: ModelShape, replica_batch: int, constraints: Constraints) -> list[int]:
    """The micro-batch sizes the candidates of :func:`plan_replica_batch` run."""
    rows: set[int] = set()
    for batch, found in _per_data_size(world, shape, replica_batch, constraints):
        rows.update(microbatch_rows(found, batch))
    return sorted(rows)


def _any_candidate(
    which: Callable[[list[Candidate]], bool],
    world: int,
    shape: ModelShape,
    replica_batch: int,
    constraints: Constraints,
) -> bool:
    return any(which(found) for _, found in _per_data_size(world, shape, replica_batch, constraints))


def needs_sharded_step(world: int, shape: ModelShape, replica_batch: int, constraints: Constraints) -> bool:
    """Whether a candidate of :func:`plan_replica_batch` shards its parameters (FSDP2): not with
    one process, a data-parallel size fixed to 1 or another data mode fixed."""
    return _any_candidate(shards_parameters, world, shape, replica_batch, constraints)


def needs_split_backward(world: int, shape: ModelShape, replica_batch: int, constraints: Constraints) -> bool:
    """Whether a candidate of :func:`plan_replica_batch` runs a zero-bubble schedule: not with one
    process, a pipeline size fixed to 1 or another schedule fixed."""
    return _any_candidate(splits_backward, world, shape, replica_batch, constraints)


def check_constraints(world: int, shape: ModelShape, replica_batch: int, constraints: Constraints) -> None:
    """Raise ``ValueError`` naming the constraints when no layout of ``world`` processes meets them
    (the same on every rank: no collective)."""
    if next(_per_data_size(world, shape, replica_batch, constraints), None) is not None:
        return
    sizes = sorted(t for t in shape.tensor_parallel_sizes if world % t == 0)
    raise ValueError(
        f"No layout of {world} processes meets {constraints.describe()} for this model ({shape.num_layers} "
        f"pipeline layers, tensor sizes its plan accepts: {sizes}) with {replica_batch} samples per "
        "replica: pipeline x tensor x data must equal the processes, the pipeline have at most one stage "
        "per layer, the micro-batches divide the batch. Leave a size free or change the devices."
    )


def probe_machine(
    device: torch.device, memory_bytes: float, slots_work: Callable[[], object] | None = None
) -> Machine:
    """The default process group's processes as the cost model sees them, the same on every rank
    (collective): the links probed three times, spread between the other probes so that a stretch
    of other work on a shared host spoils one at most (each number the median:
    :func:`~lightning_pipe.planning.links.median_links`); on CPU, how many processes
    compute at once (gloo processes on one host's cores share them: whether a pipeline's idle
    ranks cost anything; ``slots_work``: the work it times, matrix products by default) and what
    each collective waits for its last rank there. One process has nothing to probe: its plans
    have no communication. About 10 s on this project's 4 processes on 2 cores (the links 1.5 s of
    it, the wait 5 s), against 3.5 s when the links were probed once and no wait was."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return Machine(1, memory_bytes, Links(overlap_data_parallel=device.type == "cuda"))
    shared = device.type == "cpu"
    links = [probe_links(device)]
    slots = probe_compute_slots(device, work=slots_work) if shared else None
    links.append(probe_links(device))
    wait = probe_collective_wait(device) if shared else 0.0
    links.append(probe_links(device))
    return Machine(
        world, memory_bytes, median_links(links), compute_slots=slots, collective_wait_seconds=wait
    )


def decide_layout(
    layers: Sequence[nn.Module],
    sample_at: Callable[[int], Any],
    replica_batch: int,
    device: torch.device,
    memory_bytes: float,
    shape: ModelShape,
    constraints: Constraints,
    splits: Sequence[LayerSplit] | None = None,
    optimizer_state_factor: float = 2.0,
    repeats: int = 3,
    optimizer: OptimizerFactory | None = None,
) -> Plan:
    """The plan every rank of the default process group agrees on; collective (every rank calls
    it with the same arguments but ``sample_at``, which only global rank 0 calls).

    ``layers``: as :func:`measured_layers` gives them; ``sample_at(r)``: the first layer's input
    for ``r`` samples; ``replica_batch``: the samples one data-parallel replica steps on;
    ``optimizer``: the run's optimizer, whose step is timed per layer (default AdamW, which the
    memory's ``optimizer_state_factor`` of 2 also assumes: at setup the user's optimizer does not
    exist yet)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    check_constraints(world, shape, replica_batch, constraints)
    machine = probe_machine(device, memory_bytes)
    payload: list[Any] = [None]
    if rank == 0:
        try:
            rows = max(1, replica_batch // 2)  # measured at rows and 2 x rows: within the batch
            sizes = measurement_sizes(needed_rows(world, shape, replica_batch, constraints), rows)
            costs = measure_model(
                layers, sample_at, rows, device, splits, repeats, optimizer_state_factor,
                optimizer if optimizer is not None else adamw, sizes,
                sharded=needs_sharded_step(world, shape, replica_batch, constraints),
                split_backward=needs_split_backward(world, shape, replica_batch, constraints),
            )  # fmt: skip
            payload = [plan_replica_batch(costs, machine, shape, replica_batch, constraints)]
        except Exception as err:  # said on every rank: the others would otherwise wait for the plan
            payload = [f"{type(err).__name__}: {err}"]
            if world == 1:
                raise
    if world > 1:
        dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    if isinstance(payload[0], str):
        raise RuntimeError(f"Global rank 0 could not measure the model for layout='auto': {payload[0]}")
    return payload[0]


def record(plan: Plan) -> dict[str, Any]:
    """The decision as plain values (for a checkpoint's metadata and the logs)."""
    best = plan.chosen()
    return {
        "layout": str(best.candidate),
        **best.candidate.options(),
        "data_mode": best.candidate.data_mode.value,
        "predicted_seconds_per_replica_batch": best.step_seconds,
        "predicted_peak_bytes": best.peak_bytes,
        "memory_limit_bytes": plan.memory_bytes,
        "replica_batch": plan.batch,
    }


def describe(plan: Plan, top: int = 5) -> str:
    """The layout log's lines for ``plan`` (the table and why the winner won)."""
    return (
        f"pipe_tp layout='auto': {len(plan.predictions)} candidates, {format_bytes(plan.memory_bytes)} per "
        f"rank; times per {plan.batch} samples (one replica's batch: a layout with dp replicas steps on "
        f"dp x {plan.batch})\n{render(plan, top)}"
    )
