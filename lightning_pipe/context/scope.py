"""The context shard a step runs under: which group a model's attention calls pass key/value
blocks around, and the global positions of this rank's tokens.

The engine (or a training loop without it) enters :func:`context_shard` around a micro-batch's
forward and backward; :func:`lightning_pipe.context.ring_attention` reads it, so a hand-written
model marks its attention call once and needs no other change. Outside any shard the call is
plain attention over the whole (unsplit) sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextShard:
    """One rank's part of a sequence split over a context group.

    Attributes:
        group: the context group whose ranks hold the other parts (``None``: a group of one).
        positions: the global positions of this rank's tokens, in its order (see
            :func:`lightning_pipe.context.chunk_indices`); the causal mask and rotary tables use them.
        key_mask: ``[batch, local tokens]``, ``True`` for a real token and ``False`` for padding
            (of this rank's tokens), or ``None`` when nothing is padded.
        documents: ``[batch, local tokens]``, the document of each token of packed sequences
            (a query attends only within its document), or ``None``: one document per row.
    """

    group: dist.ProcessGroup | None
    positions: torch.Tensor
    key_mask: torch.Tensor | None = None
    documents: torch.Tensor | None = None


_active: list[ContextShard] = []
_ring_calls = [0]


@contextmanager
def context_shard(shard: ContextShard) -> Iterator[ContextShard]:
    """Run the body (a forward, and the backward of what it built) under ``shard``."""
    _active.append(shard)
    try:
        yield shard
    finally:
        _active.pop()


def active_shard() -> ContextShard | None:
    """The innermost shard entered, or ``None`` outside any."""
    return _active[-1] if _active else None


def note_ring_call() -> None:
    """Count one ring attention call under a shard (the runtime checks, on the first training
    batch, that the model's attention went through the ring at all)."""
    _ring_calls[0] += 1


def ring_calls() -> int:
    """Ring attention calls under a shard so far in this process."""
    return _ring_calls[0]


def token_positions(tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the ``tokens`` tokens a model is given: the active shard's (this
    rank's chunks), or ``0..tokens-1`` outside any. A hand-written model builds its position
    embeddings from them, so that it needs no other change under context parallelism."""
    shard = active_shard()
    if shard is None:
        return torch.arange(tokens, device=device)
    if shard.positions.shape != (tokens,):
        raise ValueError(
            f"token_positions({tokens}): the active context shard holds {shard.positions.numel()} "
            "tokens of each sequence; give the length of this rank's part."
        )
    return shard.positions.to(device)
