"""The Lightning-free runtime: one object that trains a model over a dp x pp x tp mesh.

This package is the engine's face to its callers (the Lightning adapter, or a loop without a
Trainer, ``examples/train_engine.py``): :class:`ParallelRuntime`, whose class docstring lists what
a caller may call, its options, and the vocabulary of its signatures, including the few types it
takes from the layers below it (the partition it reports, the recomputation mode of its options,
the recorder a step takes, the errors a step or ``keep_own`` raises), so that a caller needs no
module inside the engine (``tests/test_architecture.py`` holds the adapter to that).
"""

from lightning_pipe.data_parallel.sharded_optimizer import ShardingError
from lightning_pipe.execution.p2p import PipelineCommunicationError
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.execution.timeline import TimelineRecorder, gather_timeline
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.batch import BatchResult, Microbatch
from lightning_pipe.runtime.grad_scaler import AgreedGradScaler
from lightning_pipe.runtime.gradients import GradientSharding
from lightning_pipe.runtime.holdings import Holdings
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions, as_timeout
from lightning_pipe.runtime.prepare import preparation_of, prepared_mesh
from lightning_pipe.runtime.runtime import ParallelRuntime

__all__ = [
    "AgreedGradScaler",
    "BatchResult",
    "ConfigurationError",
    "GradientSharding",
    "Holdings",
    "Microbatch",
    "ModelHooks",
    "ParallelRuntime",
    "PipelineCommunicationError",
    "PipelinePartition",
    "RecomputeMode",
    "RuntimeOptions",
    "ShardingError",
    "TimelineRecorder",
    "as_timeout",
    "gather_timeline",
    "preparation_of",
    "prepared_mesh",
]
