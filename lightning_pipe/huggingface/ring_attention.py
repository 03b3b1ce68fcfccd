"""Ring attention for Hugging Face models, through transformers' public attention interface.

:func:`use_ring_attention` registers :func:`ring_attention_forward` in
``transformers.AttentionInterface`` under :data:`RING_ATTENTION` and selects it on the model
(``model.set_attn_implementation``): every family whose attention layers call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` then runs
:func:`lightning_pipe.context.ring_attention` with no wrapper around the model. No mask function
is registered under the name, so transformers builds no mask: the causal mask, the sliding window
and the padding come from the global positions and key mask of the active context shard
(:class:`lightning_pipe.context.ContextShard`), which the caller sets with the rank's chunks; the
rotary tables follow from the ``position_ids`` (the global positions) given to the model.

Sliding windows are computed exactly (Hugging Face's rule: a key within ``sliding_window`` of the
query). Attention logit soft-capping (gemma2) and attention sinks (gpt-oss) are refused, naming the
family: the ring's online softmax would need their terms in every block (not written yet).
Attention dropout in training is refused (the ring draws no dropout masks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipe.context import ContextParallelError, active_shard, ring_attention

RING_ATTENTION = "lightning_pipe_ring"
"""The name :func:`ring_attention_forward` is registered under in transformers' attention
interface."""


def _family(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    return str(getattr(config, "model_type", type(module).__name__))


def ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``query`` ``[batch, heads, tokens, head_dim]``, key and
    value with the model's key/value heads) returning ``([batch, tokens, heads, head_dim], None)``."""
    family = _family(module)
    if active_shard() is None:
        # transformers builds no mask for this implementation: outside a shard the padding would
        # be unknown here, so a left-padded batch would attend to its padding silently.
        raise ContextParallelError(
            f"{family}'s attention is {RING_ATTENTION!r} (ring attention), which runs only inside a "
            "context shard (lightning_pipe.context.context_shard) that gives the padding and positions; "
            "outside one, select the model's own attention again: model.set_attn_implementation('sdpa')."
        )
    if softcap is not None:
        raise ContextParallelError(
            f"Context parallelism: {family} soft-caps its attention logits (softcap={softcap}), which ring "
            "attention does not compute; train this family with its own attention: context_parallel_size=1 "
            "(or, in a loop of your own, model.set_attn_implementation('sdpa'))."
        )
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ContextParallelError(
            f"Context parallelism: {family} has attention sinks, which ring attention does not compute; "
            "train this family with its own attention: context_parallel_size=1 (or, in a loop of your own, "
            "model.set_attn_implementation('sdpa'))."
        )
    if dropout:
        raise ContextParallelError(
            f"Context parallelism: {family}'s attention dropout is {dropout} in training, and ring attention "
            "draws no dropout masks; set the config's attention_dropout to 0."
        )
    out = ring_attention(
        query,
        key,
        value,
        causal=bool(getattr(module, "is_causal", True)),
        window=sliding_window,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def use_ring_attention(model: Any) -> None:
    """Register :func:`ring_attention_forward` with transformers (once) and make ``model``'s
    attention layers call it."""
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
    model.set_attn_implementation(RING_ATTENTION)
