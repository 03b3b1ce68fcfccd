"""lightning_pipe: pipeline, tensor and data parallelism for PyTorch Lightning.

The public API is listed here once. The engine (mesh, schedules, partitioning, execution, runtime,
checkpoint format) is plain torch, usable without a Trainer, and importing it does not import
Lightning: :class:`PipeTPStrategy` (the adapter) is imported when it is first used, and the name
``"pipe_tp"`` is registered with Lightning as soon as Lightning loads.
"""

import warnings
from typing import Any

from lightning_pipe._registration import register_with_lightning
from lightning_pipe.batches.agreement import StepCheckError
from lightning_pipe.batches.microbatch import signature, split_microbatches
from lightning_pipe.checkpoint import (
    CheckpointDirectory,
    CheckpointError,
    consolidate_checkpoint,
    is_checkpoint_directory,
    load_from_checkpoint,
)
from lightning_pipe.execution.executor import PipelineExecutor, StepResult
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.huggingface import CausalLMPipeline, export_huggingface
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh, RankCoordinates, init_mesh
from lightning_pipe.partition.balance import PartitionMethod, compute_balance, split_layers
from lightning_pipe.runtime import ConfigurationError, ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.batch import BatchResult, Microbatch
from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule, ScheduleError
from lightning_pipe.schedule.builders import ScheduleKind, build_schedule
from lightning_pipe.schedule.render import render_schedule
from lightning_pipe.schedule.simulate import SimulationResult, simulate
from lightning_pipe.schedule.validate import validate_schedule
from lightning_pipe.skip import Pop, SkipError, SkipRoute, Stash, pop, skip_scope, skippable, stash
from lightning_pipe.tensor_parallel.cross_entropy import cross_entropy, gather_vocab
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_pipe.tensor_parallel.plan import TensorParallelStyle

__version__ = "0.1.0"

register_with_lightning()

_DEPRECATED = {
    "ShardStyle": ("TensorParallelStyle", TensorParallelStyle),
    "ShardedCheckpoint": ("CheckpointDirectory", CheckpointDirectory),
    "is_sharded_checkpoint": ("is_checkpoint_directory", is_checkpoint_directory),
    "CheckpointMode": ("RecomputeMode", RecomputeMode),
}
"""Former names, kept for one minor release: each warns, naming its replacement."""


def __getattr__(name: str) -> Any:
    if name == "PipeTPStrategy":  # the Lightning adapter, imported on first use
        from lightning_pipe.strategy import PipeTPStrategy

        return PipeTPStrategy
    if name == "CausalLMModule":  # a ready LightningModule, imported on first use
        from lightning_pipe.modules import CausalLMModule

        return CausalLMModule
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"lightning_pipe.{name} is deprecated: use lightning_pipe.{new} (one name per idea: "
            "'checkpoint' means saved state, 'shard' the optimizer state's sharding).",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")


__all__ = [
    "Action",
    "ActionType",
    "BatchResult",
    "CausalLMModule",
    "CausalLMPipeline",
    "CheckpointDirectory",
    "CheckpointError",
    "ColumnParallelLinear",
    "ConfigurationError",
    "MeshAxis",
    "Microbatch",
    "ParallelLayout",
    "ParallelMesh",
    "ParallelRuntime",
    "PartitionMethod",
    "PipeTPStrategy",
    "PipelineExecutor",
    "PipelineSchedule",
    "Pop",
    "RankCoordinates",
    "RecomputeMode",
    "RowParallelLinear",
    "RuntimeOptions",
    "ScheduleError",
    "ScheduleKind",
    "SimulationResult",
    "SkipError",
    "SkipRoute",
    "Stash",
    "StepCheckError",
    "StepResult",
    "TensorParallelStyle",
    "VocabParallelEmbedding",
    "apply_layers",
    "build_schedule",
    "compute_balance",
    "consolidate_checkpoint",
    "cross_entropy",
    "export_huggingface",
    "gather_vocab",
    "init_mesh",
    "is_checkpoint_directory",
    "load_from_checkpoint",
    "pop",
    "render_schedule",
    "signature",
    "simulate",
    "skip_scope",
    "skippable",
    "split_layers",
    "split_microbatches",
    "stash",
    "validate_schedule",
]
