"""Check, on the first batch, that each decoder layer a rank holds computes the same under sequence
parallelism as without it.

The derived sequence-parallel plan (:mod:`lightning_pipe.huggingface.tensor_parallel`) decides from
a decoder layer's *modules* which of them see the whole sequence (those holding split layers
gather it) and which compute token by token on this rank's part (norms, dropouts). What the layer's
own ``forward`` does between its modules is not visible to that decision: a family that mixes
tokens there (a token shift, a cumulative sum, a convolution written inline), or a parameterless
child module that does, would compute on a part of the sequence what one device computes on the
whole, silently. So every rank runs each of its decoder layers once on a random hidden state of the
first batch's shape, with sequence parallelism suspended (the whole sequence, as one device) and
active (its part, the outputs all-gathered), in eval mode and without gradients, and the two must
agree to float rounding. A collective over the tensor group (every rank of a stage holds the same
layers, so the gathers pair up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.layers import evaluating
from lightning_pipe.huggingface.check import random_hidden
from lightning_pipe.tensor_parallel.regions import (
    SEQUENCE_DIM,
    all_gather_sequence,
    sequence_parallel_suspended,
)

if TYPE_CHECKING:
    from lightning_pipe.huggingface.view import PipelineView

_TOLERANCE = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-5)}
"""(rtol, atol) by dtype; others (bfloat16, float16): 2e-2 both. A token mixed on a part of the
sequence differs by the size of the activations, far above these."""


def check_sequence_split(
    pipeline: PipelineView, probe: Any, own_layers: Sequence[nn.Module], group: dist.ProcessGroup
) -> str | None:
    """An error naming the first decoder layer of ``own_layers`` whose output on this rank's part
    of the sequence, gathered, differs from its output on the whole sequence; ``None`` if none
    does (or the sequence does not split evenly: the runtime reports that itself)."""
    parts = pipeline.parts
    layers = list(getattr(parts.base, parts.layers_name))
    own = [(i, layer) for i, layer in enumerate(layers) if any(layer is o for o in own_layers)]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    input_ids, mask, positions = probe
    if not own or size == 1 or input_ids.shape[1] % size != 0:
        return None
    weight = next((p for _, layer in own for p in layer.parameters()), None)
    dtype = weight.dtype if weight is not None else torch.get_default_dtype()
    device_type = input_ids.device.type
    # Under autocast (bf16-mixed, with or without FSDP's param_dtype) the layers compute in the
    # autocast dtype, whatever the parameters' dtype: its rounding sets the tolerance.
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype
    hidden = random_hidden(parts, input_ids, dtype)  # the same on every tensor rank
    mine = hidden.chunk(size, dim=SEQUENCE_DIM)[rank].contiguous()
    rtol, atol = _TOLERANCE.get(compute, (2e-2, 2e-2))
    problem = None
    with evaluating(pipeline.model), torch.no_grad():  # no dropout: both runs must draw nothing
        for index, layer in own:
            call = pipeline.decoder_call(index)
            with sequence_parallel_suspended():
                whole = call(layer, (hidden, mask, positions))[0]
            pipeline.context.forget()
            part = call(layer, (mine, mask, positions))[0]
            pipeline.context.forget()
            # Every rank gathers for every layer, whatever it found, so that the gathers pair up.
            gathered = all_gather_sequence(part.contiguous(), group, "sequence_check")
            if problem is None and not torch.allclose(gathered, whole, rtol=rtol, atol=atol):
                gap = (gathered - whole).abs().max().item()
                problem = (
                    f"Under sequence_parallel=True decoder layer {index} of {parts.family} "
                    f"({type(layer).__name__}) computes on each tensor rank's part of the sequence "
                    f"something other than on the whole sequence (up to {gap:.3g} apart on a random "
                    "hidden state): it mixes tokens outside the modules pipe_tp gathers (in its own "
                    "forward, or in a module without parameters). Use sequence_parallel=False for "
                    "this model."
                )
    return problem
