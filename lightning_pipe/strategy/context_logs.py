"""Logged values made the whole sequences' under context parallelism.

With ``context_parallel_size = C > 1`` each rank of a context group runs the user's step on its
part of the same sequences, so a value it logs (a loss: a mean over its part's tokens) is its
part's. As the runtime does for the loss it returns, every record is made the whole sequences':
each rank's value weighted by its loss items (tokens) of the batch, summed over the context group
and divided by the group's items. One all-reduce per batch carries every record (and, in front,
the count and a digest of the logged names, so that ranks logging different keys are refused
rather than mixed: on the CPU at once; on CUDA, where reading the verdict would stall the step,
their values become NaN); it runs on every rank, each pipeline stage in its own context group, after the
records reached it from the last stage, so every rank replays the same values.

A torchmetrics ``Metric`` is updated with each rank's part, and its states are not combined here
(a metric's meaning decides whether summing them is right): it is warned about once.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.strategy.log_capture import LoggedValue

SLOTS = 64
"""The values travel in a tensor padded to a multiple of this many records, so that ranks that
log a few keys more or fewer still exchange tensors of one size (and the digest refuses them)."""

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        rank_zero_warn(message)


def _digest(records: Sequence[LoggedValue]) -> int:
    """16 bits of the logged names in order: ``C x digest^2`` sums stay exact in float64."""
    names = "\0".join(f"{r.fx}/{r.name}" for r in records)
    return zlib.crc32(names.encode()) & 0xFFFF


def whole_over_context(
    records: Sequence[LoggedValue],
    items: float | None,
    samples: int,
    group: dist.ProcessGroup,
    size: int,
    device: torch.device,
    read_verdict: bool | None = None,
) -> None:
    """Make each value of ``records`` (in place) the context group's: weighted by ``items`` (this
    rank's loss items of the batch; its ``samples`` when the batch counts none). ``read_verdict``:
    refuse different keys at once (``None``: on the CPU, where reading waits for nothing)."""
    # No early return without records: a rank that logged nothing must still meet a peer that
    # logged something in the all-reduce (and be refused with it), not leave it waiting.
    plain = [r for r in records if r.metric_attribute is None]
    metrics = [r.metric_attribute for r in records if r.metric_attribute is not None]
    if metrics:
        _warn_once(
            "metric",
            f"pipe_tp: context_parallel_size={size}: the torchmetrics Metric(s) {sorted(set(metrics))} are "
            "updated with each rank's part of the sequences, and their states are not combined over the "
            "context group, so their values are this rank's part's, not the whole sequences'. Log a tensor "
            "instead (e.g. the loss: combined over the group, weighted by tokens), or use "
            "context_parallel_size=1 for such metrics.",
        )
    if items is None:
        _warn_once(
            "items",
            f"pipe_tp: context_parallel_size={size}: this evaluation batch counts no loss items (tokens), so "
            "the values it logs are combined over the context group with equal weights: a mean of the "
            "parts' means, not the whole sequences'. Give a Hugging Face batch its 'labels', or define "
            "loss_items(batch) on the LightningModule.",
        )
    weight = float(samples if items is None else items)
    n = len(plain)
    digest = float(_digest(records))
    slots = SLOTS * max(1, -(-n // SLOTS))
    # [count, digest, digest^2, weight, 1, value_i * weight ..., value_i ...], in float64
    stacked = torch.zeros(5 + 2 * slots, dtype=torch.float64, device=device)
    stacked[:5] = torch.tensor([n, digest, digest * digest, weight, 1.0], dtype=torch.float64)
    if n:
        values = torch.stack(
            [torch.as_tensor(r.value, dtype=torch.float64).to(device).reshape(()) for r in plain]
        )
        stacked[5 : 5 + n] = values * weight
        stacked[5 + slots : 5 + slots + n] = values
    dist.all_reduce(stacked, group=group)
    # The verdict on the names stays on the device: on CUDA reading it would stall the step.
    count, digests, squares, weights = stacked[0], stacked[1], stacked[2], stacked[3]
    agreed = (count == n * size) & (digests == digest * size) & (digests * digests == size * squares)
    if (device.type == "cpu" if read_verdict is None else read_verdict) and not bool(agreed):
        names = [f"{r.fx}/{r.name}" for r in records]
        raise MisconfigurationException(
            f"context_parallel_size={size}: the ranks of a context group logged different keys in this batch "
            f"(this rank: {names}), so their values cannot be made the whole sequences'. Log the same keys "
            "in the same order on every rank (e.g. not under a condition on the rank's part of the batch)."
        )
    if n == 0:
        return
    weighted = stacked[5 : 5 + n] / torch.where(weights > 0, weights, 1.0)
    plain_mean = stacked[5 + slots : 5 + slots + n] / size  # no rank holds an item: the parts' mean
    whole = torch.where(weights > 0, weighted, plain_mean)
    # On CUDA the verdict is not read: values of ranks that logged different keys become NaN
    # rather than a silent mix of other keys' values.
    whole = torch.where(agreed, whole, torch.full_like(whole, float("nan")))
    for record, value in zip(plain, whole, strict=True):
        record.weighted_sum = value * record.weight
