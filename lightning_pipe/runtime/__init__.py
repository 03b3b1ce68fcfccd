"""The Lightning-free runtime: one object that trains a model over a dp x pp x tp mesh."""

from lightning_pipe.runtime.batch import BatchResult, Microbatch
from lightning_pipe.runtime.gradients import GradientSharding
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.runtime.runtime import ParallelRuntime

__all__ = [
    "BatchResult",
    "ConfigurationError",
    "GradientSharding",
    "Microbatch",
    "ParallelRuntime",
    "RuntimeOptions",
]
