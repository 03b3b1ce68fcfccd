"""What a batch goes through before a schedule runs it: the split into micro-batches, the
agreement of a replica's ranks on the batch (and of all ranks on the end of a loop), and the
check that ``forward`` is the chained pipeline layers."""
