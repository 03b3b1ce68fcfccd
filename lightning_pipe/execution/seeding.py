"""Layer-seeded random draws: each pipeline layer's dropout masks follow from where the layer is
in the model and which batch and micro-batch it computes, not from which rank runs it.

With the default random stream, each rank draws from its own generator, so a pipeline stage draws
what one device would have drawn only if it happened to hold the whole model: a pp=2 run never
meets one device's masks. Megatron-LM accepts this (its model-parallel RNG tracker keeps masks
reproducible, not equal across layouts). Here each layer's forward instead starts from a seed made
of (the run's seed, the training batch, the micro-batch, the layer's global index) and draws from
there, inside a forked random state (what the rest of the program draws is untouched). Any layout
then draws the same masks for the same layer on the same micro-batch: a run equals the same model
under pipe_tp on one process with the same ``num_microbatches``, whatever the pipeline split.

Recomputation replays the same draws by construction: torch's checkpoint re-runs the layers
(reseeding each), and a zero-bubble replay does the same.

Tensor ranks share the seed, so a layer computed whole on each of them draws one mask; under
sequence parallelism each keeps its part of the whole sequence's mask
(:class:`~lightning_pipe.tensor_parallel.dropout.SequenceDropout`). Data-parallel replicas share it
too, as in Megatron: their micro-batches get equal masks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def layer_seed(seed: int, batch: int, microbatch: int, layer: int) -> int:
    """The seed of ``layer`` (its global index in the pipeline) on ``microbatch`` of training batch
    ``batch``, in a run seeded with ``seed``: a hash, so that neighbouring keys give unrelated
    streams."""
    key = f"{seed}:{batch}:{microbatch}:{layer}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from ``seed`` inside the block (the host's generator and ``device``'s), and continue
    the program's own random streams after it as if nothing was drawn."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
