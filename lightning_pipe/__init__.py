"""lightning_pipe: pipeline, tensor and data parallelism for PyTorch Lightning.

The top level holds what a Lightning user and a model author need: the strategy, the ready
Hugging Face module, the skip-connection helpers a ``configure_pipeline()`` may use, loading a
checkpoint into a fresh module, and the errors worth catching. Everything else lives in the
subpackage that owns it, each listing its public names in ``__all__``:

* :mod:`lightning_pipe.runtime`: the Lightning-free engine (``ParallelRuntime``, ``RuntimeOptions``);
* :mod:`lightning_pipe.mesh`: the layout and process groups (``ParallelLayout``, ``init_mesh``);
* :mod:`lightning_pipe.schedule`: schedules as data (``build_schedule``, ``simulate``, ...);
* :mod:`lightning_pipe.execution`: the interpreter of a schedule (``PipelineExecutor``);
* :mod:`lightning_pipe.partition`, :mod:`lightning_pipe.batches`: stages and micro-batches;
* :mod:`lightning_pipe.tensor_parallel`: Megatron layers, the plan, vocab-parallel loss;
* :mod:`lightning_pipe.checkpoint`, :mod:`lightning_pipe.huggingface`: checkpoint tools, export;
* :mod:`lightning_pipe.skip`: the whole skip-connection API.

Importing the package does not import Lightning: :class:`PipeTPStrategy` (the adapter) and
``CausalLMModule`` are imported when first used, and the name ``"pipe_tp"`` is registered with
Lightning as soon as Lightning loads.
"""

from typing import Any

from lightning_pipe._registration import register_with_lightning
from lightning_pipe.batches.agreement import StepCheckError
from lightning_pipe.checkpoint import CheckpointError, load_from_checkpoint
from lightning_pipe.faults.board import PeerLostError
from lightning_pipe.huggingface.outputs import ModelCallError
from lightning_pipe.runtime.options import ConfigurationError
from lightning_pipe.skip import Pop, Stash, pop, skippable, stash

__version__ = "0.2.0"  # the one place the version is written: pyproject.toml reads it (dynamic)

register_with_lightning()


def __getattr__(name: str) -> Any:
    if name == "PipeTPStrategy":  # the Lightning adapter, imported on first use
        from lightning_pipe.strategy import PipeTPStrategy

        return PipeTPStrategy
    if name == "CausalLMModule":  # a ready LightningModule, imported on first use
        from lightning_pipe.modules import CausalLMModule

        return CausalLMModule
    raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")


__all__ = [
    "CausalLMModule",
    "CheckpointError",
    "ConfigurationError",
    "ModelCallError",
    "PeerLostError",
    "PipeTPStrategy",
    "Pop",
    "Stash",
    "StepCheckError",
    "load_from_checkpoint",
    "pop",
    "skippable",
    "stash",
]
