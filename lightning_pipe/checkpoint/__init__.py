"""Sharded checkpoints: every rank saves its own part; any layout loads them; one command
consolidates them into an ordinary Lightning checkpoint. Plain torch: the strategy adapts them."""

from lightning_pipe.checkpoint.load import load_from_checkpoint
from lightning_pipe.checkpoint.metadata import CheckpointError, is_checkpoint_directory
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.single_file import consolidate_checkpoint

__all__ = [
    "CheckpointDirectory",
    "CheckpointError",
    "consolidate_checkpoint",
    "is_checkpoint_directory",
    "load_from_checkpoint",
]
