"""Running a schedule on one pipeline rank: the interpreter (with its exchanges, skip routing and
memory metering), point-to-point transport, the split of backward into input and weight
gradients, activation recomputation, deferred BatchNorm, and recording the run's timeline."""

from lightning_pipe.execution.executor import PipelineExecutor, StepResult
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.execution.p2p import PipelineCommunicationError
from lightning_pipe.execution.recompute import RecomputeMode

__all__ = [
    "PipelineCommunicationError",
    "PipelineExecutor",
    "RecomputeMode",
    "StepResult",
    "apply_layers",
]
