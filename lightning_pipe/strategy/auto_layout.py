"""``PipeTPStrategy(layout="auto")``: what the strategy hands the planner, and what it keeps.

The decision itself is the engine's (:mod:`lightning_pipe.planning.auto`: links probed in the
real group, layers measured on global rank 0, the plan broadcast). This module reads what only
Lightning knows: which options the user set (:func:`auto_constraints`: an option left at the
constructor's default is the planner's to choose, any other value is kept), the module's sample
batch (``example_input_array``), its pipeline and tensor-parallel plan, and the memory each rank
may use (``max_memory``, or CUDA's free memory, the least over the ranks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.batches.microbatch import batch_size, map_tensors
from lightning_pipe.planning import Constraints, DataMode, ModelShape, Plan
from lightning_pipe.planning.auto import decide_layout, measured_layers, record
from lightning_pipe.planning.measure import accepted_tensor_sizes, device_memory
from lightning_pipe.strategy.pipeline_model import read_module

AUTO_LAYOUT_KEY = "pipe_tp_auto_layout"
"""The checkpoint entry recording what ``layout="auto"`` chose
(:func:`~lightning_pipe.planning.auto.record`)."""

PLANNED = (
    "pipeline_parallel_size",
    "tensor_parallel_size",
    "data_parallel_size",
    "num_microbatches",
    "schedule",
    "virtual_stages",
    "recompute",
    "shard_optimizer_state",
    "shard_parameters",
    "reshard_after_forward",
    "partition",
)
"""The constructor options ``layout="auto"`` chooses when they are left at their defaults."""

NOT_PLANNED = {
    "context_parallel_size": 1,
    "expert_parallel_size": 1,
    "data_parallel_replicate_size": 1,
    "sequence_parallel": False,
}
"""Options the planner does not model: under ``layout="auto"`` they must keep these values."""


def auto_constraints(arguments: Mapping[str, Any], init: Callable[..., Any]) -> Constraints:
    """The choices the user made among :data:`PLANNED`: every argument that differs from
    ``init``'s default (``PipeTPStrategy.__init__``) is kept; the rest is left to the planner.
    Refuses what the planner cannot honour (the options of :data:`NOT_PLANNED`, a list of layer
    counts per stage)."""
    for name, value in NOT_PLANNED.items():
        if arguments[name] != value:
            raise ValueError(
                f"layout='auto' does not plan {name} (got {arguments[name]!r}): leave it at {value!r}, or "
                "set the layout's sizes yourself instead of layout='auto'."
            )
    if isinstance(arguments["partition"], list | tuple):
        raise ValueError(
            f"layout='auto' chooses the number of stages, so partition={list(arguments['partition'])} (layer "
            "counts per stage) cannot apply: give a method ('time', 'parameters', 'uniform') or set the "
            "layout's sizes yourself."
        )
    defaults = {name: p.default for name, p in inspect.signature(init).parameters.items()}
    given = {name: arguments[name] for name in PLANNED if arguments[name] != defaults[name]}
    mode = None
    if given.get("shard_parameters"):
        mode = DataMode.FSDP2
    elif given.get("shard_optimizer_state"):
        mode = DataMode.ZERO1
    return Constraints(
        pipeline_parallel_size=given.get("pipeline_parallel_size"),
        tensor_parallel_size=given.get("tensor_parallel_size"),
        data_parallel_size=given.get("data_parallel_size"),
        data_mode=mode,
        schedule=given.get("schedule"),
        virtual_stages=given.get("virtual_stages"),
        num_microbatches=given.get("num_microbatches"),
        recompute=given.get("recompute"),
        reshard_after_forward=given.get("reshard_after_forward"),
    )


def memory_limit(max_memory: float | None, device: torch.device) -> float:
    """What each rank may hold: ``max_memory``, else the least free CUDA memory over the ranks."""
    if max_memory is not None:
        return max_memory
    free = device_memory(device)
    if free is None:  # checked before launch too (check_auto_memory): kept for a direct call
        raise MisconfigurationException(NEEDS_MEMORY.format(device=device.type))
    least = torch.tensor([free], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return float(least.item())


NEEDS_MEMORY = (
    "layout='auto' needs max_memory on {device} (no free memory can be read there): pass the memory each "
    "process may use, e.g. PipeTPStrategy(layout='auto', max_memory='4GB')."
)


def _cycled(example: Any, rows: int) -> Any:
    """``rows`` samples of ``example`` (a batch), its rows repeated when it has fewer."""
    size = batch_size(example)
    index = torch.arange(rows) % size
    return map_tensors(example, lambda t: t[index.to(t.device)])


def plan_module(
    module: LightningModule,
    plan_option: dict[str, str] | None,
    prefix_option: str | None,
    device: torch.device,
    memory_bytes: float,
    constraints: Constraints,
) -> Plan:
    """Measure ``module`` (global rank 0) and agree on a plan (every rank); collective."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise MisconfigurationException(
            f"layout='auto' measures each layer on a sample batch, and {type(module).__name__} gives none: "
            "set `self.example_input_array` to one batch of forward's input, of the size each data-parallel "
            "replica's dataloader yields."
        )
    view = read_module(module, True, 1, plan_option, prefix_option)
    hook = view.hooks.pipeline_input

    def sample_at(rows: int) -> Any:
        sample = _cycled(example, rows)
        return hook(sample) if hook is not None else sample

    def plan_for(size: int) -> Mapping[str, str] | None:
        try:
            return read_module(module, True, size, plan_option, prefix_option).tensor_parallel_plan
        except MisconfigurationException as err:  # a size the derived plan refuses
            raise ValueError(str(err)) from err

    world = dist.get_world_size() if dist.is_initialized() else 1
    sizes, splits = accepted_tensor_sizes(module, view.layers, plan_for, world)
    layers = measured_layers(view.layers, view.hooks.layer_calls)
    split = splits[min(splits)] if splits else None  # the same modules are split at any size
    try:
        return decide_layout(
            layers, sample_at, batch_size(example), device, memory_bytes, ModelShape(len(layers), sizes),
            constraints, split,
        )  # fmt: skip
    except ValueError as err:  # constraints no layout meets: the same sentence on every rank
        raise MisconfigurationException(f"pipe_tp layout='auto': {err}") from None


def log_choice(loggers: Sequence[Logger], plan: Plan) -> dict[str, Any]:
    """Record what ``layout="auto"`` chose in every logger's hyperparameters (flat
    ``pipe_tp_auto_layout/<name>`` keys: the layout, its options, the prediction, the memory limit;
    loggers write on global rank 0 only), and return them."""
    values = {f"{AUTO_LAYOUT_KEY}/{name}": value for name, value in record(plan).items()}
    for logger in loggers:
        logger.log_hyperparams(values)
    return values


def batch_differs(plan: Plan, batch: Any) -> str | None:
    """A warning when a training batch is not the size ``layout="auto"`` planned for (the
    module's ``example_input_array``): the predicted memory and times do not hold then."""
    try:
        size = batch_size(batch)
    except (TypeError, ValueError, IndexError):
        return None  # a batch the micro-batching reads otherwise: nothing to compare
    if size == plan.batch:
        return None
    return (
        f"layout='auto' planned for {plan.batch} samples per replica (example_input_array's batch), but the "
        f"training batches have {size}: the predicted peak memory and step time do not hold. Make "
        "example_input_array one batch of the dataloader's size."
    )
