"""What a batch goes through before a schedule runs it: the split into micro-batches, the
agreement of a replica's ranks on the batch (and of all ranks on the end of a loop), and the
check that ``forward`` is the chained pipeline layers."""

from lightning_pipe.batches.agreement import StepCheckError
from lightning_pipe.batches.microbatch import signature, split_microbatches

__all__ = [
    "StepCheckError",
    "signature",
    "split_microbatches",
]
