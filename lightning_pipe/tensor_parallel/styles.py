"""The tensor-parallel styles a plan maps module names to, and Hugging Face's names for them.

A style says how one module is sharded; it is its own module so that both the plan's checks
(:mod:`.plan`) and the derivation of a Hugging Face model's plan
(:mod:`lightning_pipe.huggingface.tensor_parallel`) read the same names, without the applier:

=================  ==========================================  =========================
style              replaces                                     with
=================  ==========================================  =========================
``colwise``        ``nn.Linear`` (output stays sharded)         :class:`ColumnParallelLinear`
``colwise_gather`` ``nn.Linear`` (output gathered)              :class:`ColumnParallelLinear`
``colwise_logits`` ``nn.Linear`` output head: vocab-sharded     :class:`ColumnParallelLinear`,
                   logits for :func:`cross_entropy`             tagged output
``rowwise``        ``nn.Linear`` (input already sharded)        :class:`RowParallelLinear`
``rowwise_split``  ``nn.Linear`` (input replicated, split)      :class:`RowParallelLinear`
``vocab``          ``nn.Embedding``                             :class:`VocabParallelEmbedding`
``dropout``        ``nn.Dropout`` inside a sharded region       :class:`RegionDropout`
``replicated_sum`` any module, kept whole; its gradients         (nothing)
                   summed over the tensor group
=================  ==========================================  =========================

``replicated_sum`` (Hugging Face's ``replicated_with_grad_allreduce``) is for a module that stays
whole on every tensor rank but sees only this rank's slice of its input: a per-head norm of the
queries and keys (Qwen3's ``q_norm``/``k_norm``) after a column split of the projections. Each rank's
gradient then covers its own heads only; the sum over the tensor group is the whole gradient, which
the runtime takes after backward, before clipping and the optimizer step. (Without the entry the
copies would drift apart, silently.)

The sequence-parallel styles (``sequence``, ``sequence_scatter``, ``sequence_gather``) mean
something only under ``sequence_parallel=True`` (see :func:`~.plan.resolve_plan`).

Attention after its projections are split: a column split of a fused QKV projection keeps whole
heads only if its output features are ordered head-major (``[q0 k0 v0 | q1 k1 v1 | ...]``), and the
attention code must read its local number of heads from the projection's (local) output size,
``qkv.out_features // (3 * head_dim)``, instead of a stored head count.
"""

from __future__ import annotations

import enum

from lightning_pipe.arguments import parse_option


class TensorParallelStyle(enum.Enum):
    COLWISE = "colwise"
    COLWISE_GATHER = "colwise_gather"
    COLWISE_LOGITS = "colwise_logits"
    ROWWISE = "rowwise"
    ROWWISE_SPLIT = "rowwise_split"
    VOCAB = "vocab"
    DROPOUT = "dropout"
    REPLICATED_SUM = "replicated_sum"
    SEQUENCE = "sequence"
    SEQUENCE_SCATTER = "sequence_scatter"
    SEQUENCE_GATHER = "sequence_gather"

    @property
    def is_column(self) -> bool:
        """A column-parallel layer (it multiplies a whole input; under sequence parallelism it
        gathers the sequence or is inside a module that does)."""
        return self in (
            TensorParallelStyle.COLWISE,
            TensorParallelStyle.COLWISE_GATHER,
            TensorParallelStyle.COLWISE_LOGITS,
        )

    @property
    def is_sequence(self) -> bool:
        """A style that only sequence parallelism gives a meaning to."""
        return self in _SEQUENCE_STYLES

    @classmethod
    def parse(cls, value: str, pattern: str) -> TensorParallelStyle:
        """Our style names, or Hugging Face's as its plans write them (``model._tp_plan``,
        ``config.base_model_tp_plan``); a Hugging Face style we do not implement is refused with
        what to do instead."""
        if isinstance(value, str) and value.lower() in HF_STYLES:
            return HF_STYLES[value.lower()]
        if isinstance(value, str):
            why = next((text for names, text in _HF_UNSUPPORTED if value.lower() in names), None)
            if why is not None:
                raise ValueError(
                    f"The tensor-parallel plan entry {pattern!r}: {value!r} is a Hugging Face style that "
                    f"pipe_tp does not support: {why}."
                )
        hint = f" (or Hugging Face's {', '.join(repr(n) for n in HF_STYLES)})"
        return parse_option(cls, value, "tensor-parallel style", context=f" for {pattern!r}", hint=hint)


_SEQUENCE_STYLES = frozenset(
    {TensorParallelStyle.SEQUENCE, TensorParallelStyle.SEQUENCE_SCATTER, TensorParallelStyle.SEQUENCE_GATHER}
)

# Hugging Face transformers' style names (5.x), as its models' plans write them, mapped to ours;
# "colwise" and "rowwise" are the same words in both.
HF_STYLES: dict[str, TensorParallelStyle] = {
    "colwise_gather_output": TensorParallelStyle.COLWISE_GATHER,
    "colwise_rep": TensorParallelStyle.COLWISE_GATHER,
    "rowwise_split_input": TensorParallelStyle.ROWWISE_SPLIT,
    "rowwise_rep": TensorParallelStyle.ROWWISE_SPLIT,
    "embedding_rowwise": TensorParallelStyle.VOCAB,
    "replicated_with_grad_allreduce": TensorParallelStyle.REPLICATED_SUM,
    "sequence_parallel": TensorParallelStyle.SEQUENCE,
}

_HF_UNSUPPORTED: tuple[tuple[frozenset[str], str], ...] = (
    (
        frozenset({"replicate"}),
        "remove the entry: every module the plan does not name stays whole (replicated) on every tensor "
        "rank; one that sees only this rank's slice of its input (a per-head norm after a column split) "
        "takes 'replicated_sum' (Hugging Face: 'replicated_with_grad_allreduce') instead",
    ),
    (
        frozenset(
            {"local_colwise", "local_rowwise", "local", "local_packed_rowwise", "local_params", "gather"}
        ),
        "Hugging Face's local styles leave the communication to the model's own code; use 'colwise', "
        "'rowwise' or 'colwise_gather_output' instead, which pipe_tp implements with their communication",
    ),
    (
        frozenset({"packed_colwise", "packed_rowwise"}),
        "a fused projection (gate and up in one Linear) must be split per half, which pipe_tp cannot do "
        "yet; leave it out of the plan (it stays whole) or build it as two Linear layers",
    ),
    (
        frozenset(
            {"grouped_gemm", "ep_router", "ep_dispatch_experts", "moe_tp_experts", "isolated"}
            | {"mla_kv_a_proj"}
        ),
        "expert parallelism and model-specific styles are not supported; leave these modules out of the "
        "plan (they stay whole on every tensor rank)",
    ),
)


def known_style(name: str) -> TensorParallelStyle | None:
    """The style named ``name`` (ours, or Hugging Face's as :data:`HF_STYLES` maps it; any case), or
    ``None`` for a name pipe_tp does not implement."""
    lowered = name.lower()
    return HF_STYLES.get(lowered) or (TensorParallelStyle(lowered) if lowered in _OURS else None)


_OURS = frozenset(style.value for style in TensorParallelStyle)
