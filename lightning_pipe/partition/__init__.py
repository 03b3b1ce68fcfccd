"""Which layers each pipeline stage holds: the balance (by parameters, layers or measured time),
the model's partition into stages with its tied weights and aliases, and the layer profiler."""

from lightning_pipe.partition.balance import PartitionMethod, compute_balance, split_layers

__all__ = [
    "PartitionMethod",
    "compute_balance",
    "split_layers",
]
