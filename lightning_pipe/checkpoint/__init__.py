"""Sharded checkpoints: every rank saves its own part; any layout loads them; one command
consolidates them into an ordinary Lightning checkpoint. Plain torch: the strategy adapts them."""

from lightning_pipe.checkpoint.consolidate import consolidate_checkpoint
from lightning_pipe.checkpoint.load import load_from_checkpoint
from lightning_pipe.checkpoint.metadata import CheckpointError, is_sharded_checkpoint
from lightning_pipe.checkpoint.reader import ShardedCheckpoint

__all__ = [
    "CheckpointError",
    "ShardedCheckpoint",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_from_checkpoint",
]
