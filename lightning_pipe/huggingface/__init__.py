"""Hugging Face causal LMs under ``pipe_tp`` with no wrappers: the pipeline, tensor-parallel plan,
checks and loss derived from the model's own public plans. Importing this package does not import
transformers; using it on a model does (the model is one already).
"""

from lightning_pipe.huggingface.export import export_huggingface
from lightning_pipe.huggingface.outputs import ModelCall, ModelCallError, causal_lm_loss
from lightning_pipe.huggingface.parts import (
    CausalLMParts,
    UnsupportedModelError,
    causal_lm_parts,
    is_causal_lm,
)
from lightning_pipe.huggingface.pipeline import CausalLMPipeline

__all__ = [
    "CausalLMParts",
    "CausalLMPipeline",
    "ModelCall",
    "ModelCallError",
    "UnsupportedModelError",
    "causal_lm_loss",
    "causal_lm_parts",
    "export_huggingface",
    "is_causal_lm",
]
