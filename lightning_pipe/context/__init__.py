"""Context parallelism: a sequence split over a context group, attention exact over the whole.

``chunks`` cuts a sequence into each rank's load-balanced part (chunks ``r`` and ``2C - 1 - r``)
and names its global positions; ``scope`` holds the shard a step runs under; ``ring`` is the
attention that passes key/value blocks around the group (:func:`ring_attention`, also the marker a
hand-written model calls in place of its attention). Plain torch; no other package of the engine.
"""

from lightning_pipe.context.chunks import (
    ContextParallelError,
    chunk_indices,
    chunk_length,
    shard_sequence,
    unshard_sequence,
)
from lightning_pipe.context.ring import ring_attention
from lightning_pipe.context.scope import (
    ContextShard,
    active_shard,
    context_shard,
    ring_calls,
    token_positions,
)

__all__ = [
    "ContextParallelError",
    "ContextShard",
    "active_shard",
    "chunk_indices",
    "chunk_length",
    "context_shard",
    "ring_attention",
    "ring_calls",
    "shard_sequence",
    "token_positions",
    "unshard_sequence",
]
