"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019, arXiv:1909.08053): layers whose weights
are split across the ranks of a tensor-parallel group, the four communication regions they are
built from, a vocabulary-parallel cross entropy, and a plan that shards a plain model (its styles,
its resolution and checks against the model, and its application)."""

from lightning_pipe.tensor_parallel.apply import apply_plan
from lightning_pipe.tensor_parallel.cross_entropy import cross_entropy, gather_vocab
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_pipe.tensor_parallel.plan import resolve_plan
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelStyle",
    "VocabParallelEmbedding",
    "apply_plan",
    "cross_entropy",
    "gather_vocab",
    "resolve_plan",
]
