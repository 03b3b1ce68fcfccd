"""Running a schedule on one pipeline rank: the interpreter, point-to-point transport, the split
of backward into input and weight gradients, activation recomputation and deferred BatchNorm."""

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
