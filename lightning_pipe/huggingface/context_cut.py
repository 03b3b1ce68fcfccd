"""A Hugging Face batch cut for context parallelism, and the shard each decoder layer runs under.

Under ``context_parallel_size = C`` each rank keeps its chunks of every sequence
(:func:`lightning_pipe.context.chunk_indices`). :func:`cut_batch` cuts a collator's dict alike:
``input_ids``, ``attention_mask`` and every other ``[batch, tokens, ...]`` tensor; ``labels`` are
shifted for next-token prediction *before* the cut and reach the step as ``shift_labels`` (a
rank's last token predicts a token another rank holds; Hugging Face's causal-LM loss takes
``shift_labels`` unshifted), and ``position_ids`` are the rank's global positions (the rotary
tables follow from them). Packed sequences (``position_ids`` restarting) are refused: their
documents would have to travel with the hidden states (not written yet).

:func:`layer_shard` is entered around each decoder layer's call: ring attention then reads that
micro-batch's padding (the carried ``attention_mask``, cut like the tokens) as its key mask,
since transformers builds no mask for the ring's attention implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from lightning_pipe.context import (
    ContextParallelError,
    ContextShard,
    active_shard,
    chunk_indices,
    context_shard,
    shard_sequence,
)
from lightning_pipe.huggingface.context import IGNORE_INDEX


def cut_batch(batch: Any, rank: int, size: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Context rank ``rank``'s part of a Hugging Face batch and its tokens' global positions
    (see the module docstring)."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ContextParallelError(
            f"context_parallel_size={size} cuts a Hugging Face batch given as a dict with 'input_ids' (and "
            "optionally 'attention_mask', 'labels'), as a collator gives it; this batch is a "
            f"{type(batch).__name__}. Return such a dict from the dataloader (the batch is cut before "
            "pipeline_input sees it), or use context_parallel_size=1."
        )
    ids = batch["input_ids"]
    seq_len = ids.shape[1]
    positions = chunk_indices(seq_len, rank, size).to(ids.device)  # refuses a length not divisible by 2C
    given = batch.get("position_ids")
    if isinstance(given, torch.Tensor) and bool((given != torch.arange(seq_len, device=given.device)).any()):
        raise ContextParallelError(
            f"context_parallel_size={size}: this batch packs several sequences per row (its position_ids "
            "are not 0..tokens-1), which pipe_tp does not split over a context group yet (each document "
            "would have to travel with the hidden states). Pad the sequences one per row instead, or use "
            "context_parallel_size=1."
        )

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            return shard_sequence(value, 1, rank, size)
        return value

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "position_ids":
            continue
        if key == "labels" and isinstance(value, torch.Tensor):
            if "shift_labels" not in batch:  # shifted first: the last token's target is elsewhere
                out["shift_labels"] = cut(F.pad(value[:, 1:], (0, 1), value=IGNORE_INDEX))
            continue
        out[key] = cut(value)
    out["position_ids"] = positions.unsqueeze(0).expand(ids.shape[0], -1).contiguous()
    return out, positions


def layer_shard(mask: torch.Tensor, positions: torch.Tensor) -> AbstractContextManager[Any]:
    """The shard a decoder layer's call runs under: the active one's group, with this
    micro-batch's padding mask (``[b, 0]``: none) and positions; nothing outside a shard."""
    shard = active_shard()
    if shard is None:
        return nullcontext()
    key_mask = None if mask.shape[-1] == 0 else mask.bool()
    return context_shard(ContextShard(shard.group, positions[0], key_mask, shard.documents))
