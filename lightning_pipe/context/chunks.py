"""The load-balanced cut of a sequence over a context group, and the global positions of each
rank's part.

Under causal attention the late tokens of a sequence attend to more keys than the early ones, so
cutting it into C contiguous parts would give the last rank most of the work. The sequence is cut
into ``2C`` equal chunks instead, and context rank ``r`` keeps chunks ``r`` and ``2C - 1 - r``
(head to tail, as torchtitan and Megatron-Core do): every rank then holds the same number of
(query, key) pairs under the causal mask. A sequence whose length is not a multiple of ``2C`` is
refused with the numbers and the fix (pad it to a multiple).
"""

from __future__ import annotations

import torch


class ContextParallelError(ValueError):
    """A batch or a model that context parallelism cannot split exactly (the message names the
    numbers and the fix)."""


def chunk_length(seq_len: int, size: int) -> int:
    """The length of one of the ``2 * size`` chunks of a sequence of ``seq_len`` tokens; refuses a
    length that is not a multiple of ``2 * size``."""
    if size < 1:
        raise ContextParallelError(f"context_parallel_size must be >= 1, got {size}.")
    if seq_len % (2 * size):
        multiple = -(-seq_len // (2 * size)) * 2 * size
        raise ContextParallelError(
            f"context_parallel_size={size} cuts each sequence into 2 x {size} = {2 * size} equal "
            f"chunks (load-balanced causal attention), but this batch's sequence length is "
            f"{seq_len}, not a multiple of {2 * size}. Pad the sequences to a multiple of "
            f"{2 * size} (here {multiple}: padding tokens masked out by the attention mask and "
            f"their labels set to -100)."
        )
    return seq_len // (2 * size)


def chunk_indices(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """The global positions of context rank ``rank``'s tokens, in its order: chunk ``rank`` then
    chunk ``2 * size - 1 - rank``."""
    if not 0 <= rank < size:
        raise ContextParallelError(f"context rank {rank} is outside a group of {size}.")
    length = chunk_length(seq_len, size)
    head = torch.arange(rank * length, (rank + 1) * length)
    tail = torch.arange((2 * size - 1 - rank) * length, (2 * size - rank) * length)
    return torch.cat([head, tail])


def shard_sequence(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Context rank ``rank``'s part of ``tensor`` along its sequence dimension ``dim`` (a copy)."""
    index = chunk_indices(tensor.shape[dim], rank, size).to(tensor.device)
    return tensor.index_select(dim, index)


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every context rank's part, by rank (the inverse of
    :func:`shard_sequence`)."""
    size = len(parts)
    seq_len = sum(part.shape[dim] for part in parts)
    length = chunk_length(seq_len, size)
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        head, tail = part.split(length, dim)
        chunks[rank], chunks[2 * size - 1 - rank] = head, tail
    return torch.cat([c for c in chunks if c is not None], dim)
