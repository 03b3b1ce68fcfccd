"""What the runtime tells its user once per run (rank 0 shows it): layouts that train a different
model than one device, or options that do nothing."""

from __future__ import annotations

from collections.abc import Sequence


def batch_norm_mixes(names: Sequence[str]) -> str:
    """The warning for a pipeline holding BatchNorm layers (``names``) under micro-batching."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"pipe_tp: the model holds BatchNorm layers ({shown}). A pipeline never holds the whole batch in "
        "one place, so in training each one normalises every micro-batch by that micro-batch's own mean and "
        "variance, not the batch's as one device does: losses, gradients and the running statistics of any "
        "BatchNorm whose input changes with them differ from one device's, the more the smaller the "
        "micro-batches (measured with micro-batches of 2 samples: training losses up to 0.6 apart within 18 "
        "steps, a second BatchNorm's running_var up to 25 apart). The running statistics are still "
        "accumulated over the whole batch (deferred batch norm). Fixes: num_microbatches=1 (exact; no "
        "overlap of the stages within a batch), a normalisation that does not mix samples (LayerNorm, "
        "GroupNorm), or BatchNorm layers in eval mode with frozen statistics (as when fine-tuning)."
    )


SHARDING_ONE_REPLICA = (
    "pipe_tp: shard_optimizer_state=True has no effect with data_parallel_size=1: the optimizer state is "
    "sharded over the data-parallel replicas, and there is one, which keeps all of it. Use "
    "data_parallel_size >= 2 (more processes), or drop the option."
)
PARAMETERS_ONE_REPLICA = (
    "pipe_tp: shard_parameters=True has no effect with data_parallel_size=1: parameters are sharded over "
    "the data-parallel ranks, and there is one, which holds all of them. Use data_parallel_size >= 2 "
    "(more processes), or drop the option."
)
BATCH_NORM_NOT_DEFERRED = (
    "pipe_tp: deferred_batch_norm=False: BatchNorm layers normalise with micro-batch statistics and update "
    "their running statistics once per micro-batch, unlike one device."
)
