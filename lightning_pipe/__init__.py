"""lightning_pipe: pipeline, tensor and data parallelism for PyTorch Lightning.

The public API is listed here once. The engine (mesh, schedules, partitioning, executor,
checkpoint format) is plain torch and usable without a Trainer.
"""

from lightning_pipe.checkpoint import (
    CheckpointError,
    ShardedCheckpoint,
    consolidate_checkpoint,
    is_sharded_checkpoint,
    load_from_checkpoint,
)
from lightning_pipe.mesh import MeshAxis, ParallelLayout, ParallelMesh, RankCoordinates, init_mesh
from lightning_pipe.pipeline.actions import Action, ActionType, PipelineSchedule, ScheduleError
from lightning_pipe.pipeline.executor import CheckpointMode, PipelineExecutor, StepResult, apply_layers
from lightning_pipe.pipeline.fingerprint import StepCheckError
from lightning_pipe.pipeline.microbatch import signature, split_microbatches
from lightning_pipe.pipeline.partition import PartitionMethod, compute_balance, split_layers
from lightning_pipe.pipeline.render import render_schedule
from lightning_pipe.pipeline.schedules import ScheduleKind, build_schedule
from lightning_pipe.pipeline.simulate import SimulationResult, simulate
from lightning_pipe.pipeline.validate import validate_schedule
from lightning_pipe.runtime import ConfigurationError, ParallelRuntime, RuntimeOptions
from lightning_pipe.strategy import PipeTPStrategy
from lightning_pipe.tensor_parallel.cross_entropy import cross_entropy, gather_vocab
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_pipe.tensor_parallel.plan import ShardStyle

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionType",
    "CheckpointError",
    "CheckpointMode",
    "ColumnParallelLinear",
    "ConfigurationError",
    "MeshAxis",
    "ParallelLayout",
    "ParallelMesh",
    "ParallelRuntime",
    "PartitionMethod",
    "PipeTPStrategy",
    "PipelineExecutor",
    "PipelineSchedule",
    "RankCoordinates",
    "RowParallelLinear",
    "RuntimeOptions",
    "ScheduleError",
    "ScheduleKind",
    "ShardStyle",
    "ShardedCheckpoint",
    "SimulationResult",
    "StepCheckError",
    "StepResult",
    "VocabParallelEmbedding",
    "apply_layers",
    "build_schedule",
    "compute_balance",
    "consolidate_checkpoint",
    "cross_entropy",
    "gather_vocab",
    "init_mesh",
    "is_sharded_checkpoint",
    "load_from_checkpoint",
    "render_schedule",
    "signature",
    "simulate",
    "split_layers",
    "split_microbatches",
    "validate_schedule",
]
