"""How the runtime reads a model that is more than its layers chained.

A model of plain layers needs none of this: the first element of a batch enters the first layer,
each layer is called with the previous one's output, the user's ``forward`` is checked against
that chain, and micro-batch losses are weighted by their shares of the samples. A model adapted
from elsewhere (a Hugging Face causal LM, :mod:`lightning_pipe.huggingface`) says otherwise, with
explicit callables gathered here (Megatron-Core's engine hooks are such callables too): what enters
the first layer, how each layer is called, how ``forward`` is checked, and how many loss items
(tokens that are not ignored) each sample holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.layers import LayerCall

ForwardCheck = Callable[[Any, Sequence[nn.Module]], tuple[str | None, str | None]]
"""``check(probe, own_layers)`` on the first batch's first micro-batch input, with the pipeline
layers this rank holds: ``(error, warning)``; an error stops every rank of the replica with that
message, a warning is shown once."""

SequenceCheck = Callable[[Any, Sequence[nn.Module], dist.ProcessGroup], str | None]
"""``check(probe, own_layers, tensor_group)``: an error that stops every rank of the replica, or
``None``."""


@dataclass(frozen=True)
class ModelHooks:
    """Explicit callables for a model that is not just its layers chained (all optional)."""

    pipeline_input: Callable[[Any], Any] | None = None
    """A (micro-)batch -> the first layer's input; a tuple or list becomes its positional
    arguments (default: the first element of a tuple/list batch, or the batch itself)."""
    layer_calls: Sequence[LayerCall | None] | None = None
    """Per pipeline layer, how it is applied (``None``: ``layer(*x)``); see
    :mod:`lightning_pipe.execution.layers`."""
    check_forward: ForwardCheck | None = None
    """Replaces the default check that the module's ``forward`` is the chained layers."""
    check_sequence: SequenceCheck | None = None
    """Under sequence parallelism, on the first batch of each kind: whether this rank's layers
    compute on their parts of the sequence what they compute on the whole (an error message, or
    ``None``); a collective over the tensor group."""
    probe_kind: Callable[[Any], Hashable] | None = None
    """A first micro-batch input -> its kind for ``check_forward`` (e.g. padded, packed, plain):
    the check runs again on the first batch of each kind not seen yet, since a model may treat the
    kinds differently (``None``: once, on the first batch). A kind computed from the device's
    values is best given as a tensor of a few numbers (the tuple of its values is the kind): the
    runtime reads it together with the batch's loss items, one wait for the device per batch."""
    loss_items: Callable[[Any], torch.Tensor | None] | None = None
    """A batch -> how many loss items each sample holds (shape ``[batch size]``), when the loss is
    a mean over items rather than over samples (a language model's mean over the tokens whose
    label is not ignored). Micro-batch losses are then weighted by their shares of the items, and
    over the data-parallel replicas by the items of the whole global batch, so that the gradient
    is that of the whole batch's mean (not a mean of per-micro-batch means). ``None`` for a batch:
    by samples."""
    cut_sequence: Callable[[Any, int, int], tuple[Any, torch.Tensor]] | None = None
    """Under context parallelism: ``cut(batch, cp_rank, cp_size)`` -> this rank's part of every
    sequence of the batch (labels shifted before the cut, positions added) and the global
    positions of its tokens (:func:`lightning_pipe.context.chunk_indices`). ``None``: every tensor
    of the batch whose dim 1 is the pipeline input's sequence length is cut alike."""
    replace_attention: Callable[[], None] | None = None
    """Under context parallelism, called once when the runtime is built: make the model's
    attention ring attention (a Hugging Face model's, through transformers' attention interface);
    raises what makes it impossible. ``None``: the model calls
    :func:`lightning_pipe.context.ring_attention` itself."""
    splits_sequence: bool = False
    """Under sequence parallelism, the layer calls split the sequence themselves (a Hugging Face
    pipeline's embedding call has its vocab-parallel embedding reduce-scatter, a module the plan
    cannot give a second style): the tensor-parallel plan then needs no ``sequence_scatter``
    entry."""
