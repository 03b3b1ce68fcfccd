"""The strategy's options: each documented once and checked once, before any process is launched.

``PipeTPStrategy``'s constructor takes two kinds of options. The engine's (how to split, schedule
and synchronise) belong to :class:`~lightning_pipe.runtime.RuntimeOptions`, which a plain-torch
loop uses without Lightning, so they are documented and checked there. The strategy's own (the
layout's sizes, the processes and their deadline, the timeline, the files it reads and writes)
are :class:`StrategyOptions` below. Each option's description is the docstring under its field;
the constructor's ``Args:`` section, which LightningCLI prints for ``--help``, is assembled from
those at import (:func:`constructor_docstring`), and :func:`split_arguments` routes each argument
by name to the dataclass that checks it. What the options cannot tell alone (whether the layout
fits the devices) is checked when the Trainer knows its devices (:func:`check_layout_fits`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pipe.arguments import check_count, check_flag
from lightning_pipe.mesh import (
    ParallelLayout,
    check_context_parallel_size,
    check_expert_parallel_size,
    check_replicate_size,
    check_tensor_groups_in_nodes,
)
from lightning_pipe.planning.auto import parse_memory
from lightning_pipe.runtime import RuntimeOptions, as_timeout
from lightning_pipe.schedule.builders import ScheduleKind

DEFAULT_TIMEOUT = timedelta(minutes=5)
START_METHODS = ("popen", "spawn", "fork", "forkserver")
LIGHTNING_PLUGINS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)
"""Constructor arguments that are Lightning's own (documented by Lightning, passed to its base)."""


@dataclass(frozen=True)
class StrategyOptions:
    """The options of ``PipeTPStrategy`` that are not the engine's, checked when made."""

    pipeline_parallel_size: int | Literal["auto"] = "auto"
    """Number of pipeline stages. ``"auto"``: what the tensor and data sizes leave (with both data
    and pipeline ``"auto"``, every device joins the pipeline)."""
    tensor_parallel_size: int = 1
    """Ranks that shard each planned layer (Megatron-style; needs a ``tensor_parallel_plan``)."""
    data_parallel_size: int | Literal["auto"] = "auto"
    """Model replicas. ``"auto"``: world size / (pipeline x tensor)."""
    layout: Literal["auto"] | None = None
    """``"auto"``: choose the layout at setup, before the model is materialised, from measurements on
    this machine: each pipeline layer's time and saved activations on the module's
    ``example_input_array`` (one replica's batch; global rank 0 measures), the parameters' bytes,
    the links between the processes, and ``max_memory``. Of the layouts that fit, the fastest per
    sample is taken: the three sizes, replicated / ZeRO-1 / FSDP2 on the data axis, the schedule and
    its virtual stages, the micro-batches and the recomputation (``partition="time"``). Every
    option among these set to another value than its default is kept as a constraint. The layout
    log prints the five best candidates and why the winner won; checkpoints record the choice.
    ``None`` (default): the sizes and options as given."""
    max_memory: int | float | str | None = None
    """With ``layout="auto"``: the memory each process may hold at its peak (parameters, gradients,
    optimizer state as AdamW keeps it, activations), in bytes or as ``"4GB"`` / ``"512MiB"``.
    Required on CPU; on CUDA the default is the least free device memory over the ranks."""
    process_group_backend: str | None = None
    """``"nccl"`` / ``"gloo"``; default by device."""
    # timeout and tensor_parallel_plan are the engine's fields too (SHARED_FIELDS): its docstrings
    # describe them; these say only what the strategy adds.
    timeout: timedelta | float | None = DEFAULT_TIMEOUT
    """Under the strategy, also the deadline of every collective (the process groups'): default 5
    minutes, a ``timedelta`` or a number of seconds; ``None``: torch's default (30 minutes)."""
    tensor_parallel_plan: dict[str, str] | None = None
    """Overrides the module's ``tensor_parallel_plan()`` hook."""
    timeline: str | None = None
    """Record the executed schedule of training steps (from step 1: step 0 pays for first-time
    allocations) on every rank and write it, at the end of ``fit``, to this path: ``.png`` for a
    plot (needs matplotlib), anything else for a Chrome trace (open in Perfetto). Also read from
    ``LIGHTNING_PIPE_TIMELINE``."""
    timeline_steps: int = 1
    """How many training steps the timeline records (default 1: one readable step)."""
    save_distributed_checkpoint: bool = True
    """``True`` (default): a checkpoint is a directory in which every rank of the first replica
    writes its own stage's and tensor slice's state, keyed by the unsliced module's names, so any
    layout can load it and ``python -m lightning_pipe.consolidate`` turns it into one file.
    ``False``: rank 0 gathers the whole model and writes one ordinary Lightning checkpoint file."""
    pretrained: str | os.PathLike[str] | None = None
    """Initial weights for a model built in ``configure_model()`` or under
    ``trainer.init_module(empty_init=True)``, each rank reading only its own stage's tensors: a
    Hugging Face directory (``model.safetensors``, or sharded with ``model.safetensors.index.json``),
    a ``.safetensors`` file, a ``pipe_tp`` checkpoint directory or a Lightning checkpoint file.
    Weights only: no optimizer or loop state (resume with ``ckpt_path``)."""
    pretrained_prefix: str | None = None
    """What the module's state-dict keys have before the files' keys (a Hugging Face model kept as
    ``self.llama``: ``"llama."``). ``None`` (default): the derived Hugging Face model's own name
    (``"model."`` for ``self.model``), else nothing."""
    start_method: str = "popen"
    """``"popen"`` (Lightning re-launches the script; torchrun and SLURM start the processes
    themselves) or ``"spawn"``/``"fork"``/``"forkserver"``."""

    def __post_init__(self) -> None:
        # One sentence per bad value, naming it, its value and what is allowed (LightningCLI shows
        # that sentence as the error). The sizes alone: the world size is known with the devices.
        check_count("tensor_parallel_size", self.tensor_parallel_size)
        for name, value in (
            ("pipeline_parallel_size", self.pipeline_parallel_size),
            ("data_parallel_size", self.data_parallel_size),
        ):
            if value != "auto":
                check_count(name, value, also="'auto'")
        check_count("timeline_steps", self.timeline_steps)
        if self.layout not in (None, "auto"):
            raise ValueError(f"layout must be 'auto' or None (the sizes as given), got {self.layout!r}.")
        if self.max_memory is not None:
            if self.layout != "auto":
                raise ValueError(
                    f"max_memory={self.max_memory!r} bounds what layout='auto' may choose, and layout is "
                    f"{self.layout!r}: pass layout='auto' too, or drop max_memory."
                )
            object.__setattr__(self, "max_memory", parse_memory(self.max_memory))
        check_flag("save_distributed_checkpoint", self.save_distributed_checkpoint)
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {list(START_METHODS)}, got {self.start_method!r}.")
        plan = self.tensor_parallel_plan
        if plan is not None and not (
            isinstance(plan, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
        ):
            raise ValueError(
                "tensor_parallel_plan must map module-name patterns to style names (a dict of strings), got "
                f"{plan!r}."
            )
        example = "; e.g. PipeTPStrategy(timeout=600) or timeout=timedelta(minutes=10)"
        object.__setattr__(self, "timeout", as_timeout(self.timeout, seconds=True, example=example))
        if self.pretrained is not None:
            if not os.path.exists(self.pretrained):
                raise FileNotFoundError(
                    f"pretrained={str(self.pretrained)!r} does not exist: pass a Hugging Face model "
                    "directory, a .safetensors file, a pipe_tp checkpoint directory or a Lightning "
                    "checkpoint file."
                )
            object.__setattr__(self, "pretrained", os.fspath(self.pretrained))


VIRTUAL_STAGES_DEFAULT = '``None`` (the strategy\'s default): 2 with ``schedule="interleaved_1f1b"``, else 1.'
"""What the strategy's ``virtual_stages=None`` means (the engine's field has no ``None``)."""


def split_arguments(arguments: Mapping[str, Any]) -> tuple[StrategyOptions, RuntimeOptions]:
    """The constructor's arguments (by name) as the strategy's and the engine's options, each
    checked by its dataclass; ``virtual_stages=None`` resolved (:data:`VIRTUAL_STAGES_DEFAULT`)."""
    own_names = [f.name for f in dataclasses.fields(StrategyOptions)]
    own = StrategyOptions(**{name: arguments[name] for name in own_names})
    # The engine's tensor_parallel_plan and timeout are filled in at setup, from the strategy's own.
    engine = {
        f.name: arguments[f.name]
        for f in dataclasses.fields(RuntimeOptions)
        if f.name in arguments and f.name not in own_names
    }
    if engine["virtual_stages"] is None:
        interleaved = ScheduleKind.parse(engine["schedule"]) is ScheduleKind.INTERLEAVED_1F1B
        engine["virtual_stages"] = 2 if interleaved else 1
    else:  # the strategy's form of the option accepts None too, and its sentence says so
        check_count("virtual_stages", engine["virtual_stages"], also="None")
    options = RuntimeOptions(**engine)
    if own.data_parallel_size != "auto":  # else once the world size is known (check_layout_fits)
        check_replicate_size(options.data_parallel_replicate_size, int(own.data_parallel_size))
        check_expert_parallel_size(options.expert_parallel_size, int(own.data_parallel_size))
        check_context_parallel_size(options.context_parallel_size, int(own.data_parallel_size))
    return own, options


def check_layout_fits(
    sizes: tuple[int | Literal["auto"], int, int | Literal["auto"]],
    options: RuntimeOptions,
    devices: int,
    nodes: int,
) -> None:
    """Refuse, when the Trainer knows its devices and before any process is launched, a layout
    (``sizes``: pipeline, tensor, data) that cannot fit them: once, in the launching process,
    instead of in every launched rank."""
    world = nodes * devices
    where = f"pipe_tp cannot lay out {world} processes ({devices} devices x {nodes} nodes)"
    try:
        layout = ParallelLayout.resolve(world, *sizes)
    except ValueError as err:
        raise MisconfigurationException(f"{where}: {err}") from None
    try:
        check_replicate_size(options.data_parallel_replicate_size, layout.data_parallel_size)
        check_expert_parallel_size(options.expert_parallel_size, layout.data_parallel_size)
        check_context_parallel_size(options.context_parallel_size, layout.data_parallel_size)
    except ValueError as err:
        raise MisconfigurationException(
            f"{where} as dp={layout.data_parallel_size} x pp={layout.pipeline_parallel_size} x "
            f"tp={layout.tensor_parallel_size}: {err}"
        ) from None
    try:
        check_tensor_groups_in_nodes(layout.tensor_parallel_size, devices, nodes)
    except ValueError as err:
        raise MisconfigurationException(f"{where} as {layout}: {err}") from None
    stages = layout.pipeline_parallel_size * options.virtual_stages
    partition = options.partition
    if isinstance(partition, list | tuple) and len(partition) != stages:
        v = f" x virtual_stages ({options.virtual_stages})" if options.virtual_stages > 1 else ""
        raise MisconfigurationException(
            f"partition={list(partition)} gives {len(partition)} stages their layer counts, "
            f"but the pipeline has {stages} stages (pipeline_parallel_size "
            f"{layout.pipeline_parallel_size}{v} on {world} processes): give one layer count per stage."
        )


def field_docs(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` -> the docstring written under it (read from the source,
    as jsonargparse and documentation generators read them; empty where the source is absent)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


SHARED_FIELDS = ("timeout", "tensor_parallel_plan")
"""Fields of both dataclasses (the strategy fills the engine's at setup). The engine's docstring
describes the option; the strategy's says only what it adds, and the constructor shows both."""


def option_descriptions() -> dict[str, str]:
    """Each constructor option -> its description: the strategy's own, else the engine's (with
    what the strategy's default means where it differs); for :data:`SHARED_FIELDS`, the engine's
    followed by the strategy's."""
    engine = field_docs(RuntimeOptions)
    if "virtual_stages" in engine:
        engine["virtual_stages"] += " " + VIRTUAL_STAGES_DEFAULT
    own = field_docs(StrategyOptions)
    for name in SHARED_FIELDS:
        if name in engine and name in own:
            own[name] = engine[name] + "\n" + own[name]
    return {**engine, **own}


def constructor_docstring(summary: str, init: Callable[..., Any]) -> str:
    """``summary`` followed by an ``Args:`` section describing each parameter of ``init`` (but
    Lightning's own plugins) in signature order, in the Google style LightningCLI reads."""
    descriptions = option_descriptions()
    lines = [inspect.cleandoc(summary), "", "Args:"]
    for name in inspect.signature(init).parameters:
        if name == "self" or name in LIGHTNING_PLUGINS or name not in descriptions:
            continue
        first, *rest = descriptions[name].splitlines()
        lines.append(f"    {name}: {first}")
        lines.extend(f"        {line}" if line else "" for line in rest)
    return "\n".join(lines) + "\n"
