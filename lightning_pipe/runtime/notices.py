"""What the runtime tells its user once per run (rank 0 shows it): layouts that train a different
model than one device, or options that do nothing."""

from __future__ import annotations

from collections.abc import Sequence

BATCH_NORM_MEASURED = (
    "measured with micro-batches of 2 samples: on a two-BatchNorm MLP training losses up to 0.6 apart "
    "within 18 steps and the second BatchNorm's running_var up to 25 apart; on another network losses "
    "up to 0.89 apart"
)
"""The size of the difference, as measured (the BatchNorm paragraph of docs/model.md)."""


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def batch_norm_refused(names: Sequence[str], num_microbatches: int | None) -> str:
    """The setup error for a pipeline holding BatchNorm layers (``names``) under micro-batching
    that the user has not chosen."""
    m = "None (2 x pipeline_parallel_size)" if num_microbatches is None else str(num_microbatches)
    return (
        f"pipe_tp: the model holds BatchNorm layers ({_shown(names)}) and num_microbatches={m}. In "
        "training each of them would normalise every micro-batch by that micro-batch's own mean and "
        "variance, not the batch's as one device does, so this trains a different model than one "
        f"device ({BATCH_NORM_MEASURED}). Choose one: num_microbatches=1 (exact; no overlap of the "
        "stages within a batch), a normalisation that does not mix samples in place of the BatchNorm "
        "layers (GroupNorm, LayerNorm; SyncBatchNorm does not help: it shares statistics across "
        "processes, not across micro-batches), or allow_batch_norm_microbatches=True to train with "
        "per-micro-batch statistics on purpose (BatchNorm layers kept in eval mode with frozen "
        "statistics, as when fine-tuning, train exactly then)."
    )


def batch_norm_mixes(names: Sequence[str]) -> str:
    """The warning for a pipeline holding BatchNorm layers (``names``) under micro-batching, once
    the user allowed it (``allow_batch_norm_microbatches=True``)."""
    return (
        f"pipe_tp: the model holds BatchNorm layers ({_shown(names)}); allow_batch_norm_microbatches=True: "
        "in training each one normalises every micro-batch by that micro-batch's own mean and "
        "variance, not the batch's as one device does: losses, gradients and the running statistics of any "
        "BatchNorm whose input changes with them differ from one device's, the more the smaller the "
        f"micro-batches ({BATCH_NORM_MEASURED}). The running statistics are still "
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
