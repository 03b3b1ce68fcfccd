"""The pieces of one batch the runtime runs: its micro-batches, the head that ends them, the result.

This is where the runtime counts and cuts micro-batches (the cutting itself, for any batch
structure, is :mod:`lightning_pipe.batches.microbatch`'s): how many a batch runs as
(:func:`count_microbatches`), the pieces with their sizes (:func:`split_batch`), their loss
shares (:func:`weighted_microbatches`), and, for ``partition="time"``, the one micro-batch the
layers are timed on (:func:`sample_microbatch`).

:meth:`ParallelRuntime.train_batch <lightning_pipe.runtime.ParallelRuntime.train_batch>` splits a
batch into :class:`Microbatch` es, feeds each one's pipeline input to the first stage and hands each
one's pipeline output, with the micro-batch itself, to the *head* on the last stage: the loss when
training (the user's ``training_step`` under Lightning), anything when evaluating. The head is the
one place where the engine calls back into its caller; a head that also has a ``results()``
method gives, once the schedule is done, a picklable summary that every rank of the pipeline
receives in :class:`BatchResult` (Lightning's logged values, the predictions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_pipe.batches.microbatch import batch_size, microbatch_sizes, split_microbatches


@dataclass(frozen=True)
class Microbatch:
    """One micro-batch of a batch, as the head receives it."""

    index: int
    data: Any
    """The micro-batch: the batch's tensors cut along dim 0 (other leaves copied)."""
    size: int
    """Its samples."""
    share: float
    """Its share of the batch (the weight of its loss in the batch's): of the batch's loss items
    when the model's hooks count them (tokens), else of its samples."""
    items: float | None = None
    """Its loss items (e.g. predicted tokens), when the hooks count them; ``None`` otherwise."""


class Head(Protocol):
    """What ends each micro-batch on the last stage."""

    def __call__(self, output: Any, microbatch: Microbatch) -> Any:
        """The micro-batch's loss (a scalar tensor, when training) or any value, from its pipeline
        output."""
        ...


ResultsOf = Callable[[], Any]
"""A head's optional ``results()``: a picklable summary, from the last stage to every rank."""


@dataclass
class BatchResult:
    """What :meth:`~lightning_pipe.runtime.ParallelRuntime.train_batch` and ``eval_batch`` return,
    the same on every rank of the pipeline but for ``outputs``."""

    device_loss: torch.Tensor | None = None
    """Training: the batch's loss, the micro-batches' losses weighted by their shares (as one
    device computes the mean over the batch), a float64 scalar on the device, not read."""
    results: Any = None
    """What the head's ``results()`` returned on the last stage (``None`` without one)."""
    items: float | None = None
    """This rank's loss items in the batch (e.g. predicted tokens; under context parallelism those
    of its part of the sequences), when the model's hooks count them; ``None`` otherwise."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """On the last stage: micro-batch index -> what the head returned for it (losses detached)."""
    num_microbatches: int = 0
    peak_stashed: int = 0
    """The most micro-batches whose activations this rank kept alive at once."""
    peak_activation_bytes: int = 0
    """Most bytes autograd saved at once (measured only when the executor is asked to)."""

    @property
    def loss(self) -> float | None:
        """:attr:`device_loss` read on the host (on CUDA the host waits for the step's work)."""
        return None if self.device_loss is None else float(self.device_loss)


def default_pipeline_input(batch: Any) -> Any:
    """The first element of a tuple/list batch, or the batch itself."""
    if isinstance(batch, tuple | list):
        if not batch:
            raise ValueError("An empty batch has no pipeline input.")
        return batch[0]
    return batch


def count_microbatches(batch: Any, wanted: int | None, pipeline_parallel_size: int) -> tuple[int, bool]:
    """How many micro-batches ``batch`` runs as, and whether that is fewer than ``wanted``:
    ``wanted`` (``None``: ``2 x pipeline_parallel_size``), capped at the batch's samples, so that
    the last batch of an epoch (``drop_last=False``) still runs, one sample per micro-batch."""
    size = batch_size(batch)
    if wanted is None:
        return max(1, min(2 * pipeline_parallel_size, size)), False
    return (size, True) if size < wanted else (wanted, False)


def split_batch(batch: Any, num_microbatches: int) -> tuple[list[int], list[Any]]:
    """The sizes of ``batch``'s ``num_microbatches`` micro-batches, and the micro-batches."""
    return microbatch_sizes(batch_size(batch), num_microbatches), split_microbatches(batch, num_microbatches)


def weighted_microbatches(
    pieces: Sequence[Any], sizes: Sequence[int], counts: Sequence[float], counted: bool
) -> list[Microbatch]:
    """The micro-batches ``pieces`` with their shares of the batch: by ``counts`` (each one's
    loss items, or samples), and by samples for a replica without items in a global batch that has
    some (data-parallel training: its losses weigh nothing) and for the logged values of such a
    part. ``counted``: whether ``counts`` are loss items (then each micro-batch carries its own)."""
    local = sum(counts)
    items = counts if counted and local > 0 else None
    shared = counts if local > 0 else [float(n) for n in sizes]
    whole = sum(shared)
    return [
        Microbatch(i, pieces[i], sizes[i], shared[i] / whole, None if items is None else items[i])
        for i in range(len(pieces))
    ]


def sample_microbatch(
    example: Any,
    wanted: int | None,
    pipeline_parallel_size: int,
    pipeline_input: Callable[[Any], Any] | None = None,
) -> Any:
    """One micro-batch of ``example`` (a batch of ``forward``'s input), split as a batch of it
    would be, and passed through ``pipeline_input`` when the model's hooks give one: what
    ``partition="time"`` times the layers on."""
    m, _ = count_microbatches(example, wanted, pipeline_parallel_size)
    sample = split_microbatches(example, m)[0]
    return pipeline_input(sample) if pipeline_input is not None else sample
