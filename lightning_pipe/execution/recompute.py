"""Activation recomputation: which micro-batches run their stage's forward again in backward, and
how (torchgpipe's three modes; the word "checkpoint" is kept for saved state).

A recomputed forward keeps only its stage input; its backward runs the forward again first. Two
mechanisms do it:

* :func:`run_recomputed`, torch's non-reentrant :func:`torch.utils.checkpoint.checkpoint`, for
  ordinary backward passes: it replays the random state, so dropout draws the same masks.
* :class:`Replay`, for zero-bubble schedules: their backward is split into an input pass and a
  weight pass, and torch's checkpoint would recompute the region once per backward call (the
  weight pass makes several). The executor instead keeps the input and the random state before
  the forward, and runs the forward again itself in the input pass, splitting that graph.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_pipe.arguments import parse_option
from lightning_pipe.execution.activation import Activation
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.skip.scope import SkipScope


class RecomputeMode(enum.Enum):
    """Activation recomputation per stage, with torchgpipe's three modes."""

    NEVER = "never"
    EXCEPT_LAST = "except_last"
    """Recompute every micro-batch but the last, whose backward follows its forward soonest."""
    ALWAYS = "always"

    @classmethod
    def parse(cls, value: RecomputeMode | str) -> RecomputeMode:
        return parse_option(cls, value, "recompute mode")

    def applies(self, microbatch: int, num_microbatches: int) -> bool:
        """Whether a training forward of ``microbatch`` keeps only its input."""
        if self is RecomputeMode.NEVER:
            return False
        return self is RecomputeMode.ALWAYS or microbatch < num_microbatches - 1


def run_in(
    scope: SkipScope | None,
    layers: Sequence[nn.Module],
    x: Any,
    stage_index: int,
    seeds: Sequence[int] | None,
) -> Activation:
    """``apply_layers(layers, x, stage_index, seeds)`` with ``scope`` the skip scope of its stashes
    and pops (entered again by each recomputation: torch's checkpoint calls this inside backward,
    where no scope is current)."""
    with scope.active() if scope is not None else nullcontext():
        return apply_layers(layers, x, stage_index, seeds)


def run_recomputed(
    layers: Sequence[nn.Module],
    x: Any,
    stage_index: int,
    seeds: Sequence[int] | None = None,
    scope: SkipScope | None = None,
) -> Activation:
    """``run_in(scope, layers, x, stage_index, seeds)`` whose activations are recomputed in
    backward. The tensors ``scope`` pops are kept (like the stage input), not recomputed."""
    is_tuple = isinstance(x, tuple)
    args = x if is_tuple else (x,)
    return torch_checkpoint(
        lambda *a: run_in(scope, layers, a if is_tuple else a[0], stage_index, seeds),
        *args,
        use_reentrant=False,
    )


@dataclass
class Replay:
    """What running a stage's forward again needs: its input and the random state before it
    (so that dropout draws the same masks, as :func:`torch.utils.checkpoint.checkpoint` does)."""

    inputs: Any
    cpu_state: torch.Tensor
    cuda: tuple[torch.device, torch.Tensor] | None
    seeds: Sequence[int] | None = None
    """The layers' seeds under layer-seeded dropout (the same draws again by construction)."""
    output: Activation | None = None
    """On the last stage: the leaves standing for the first forward's output, which the loss was
    computed from (its gradient at them starts the replayed forward's backward)."""
    scope: SkipScope | None = None
    """The stage's skip scope: the replay pops the same tensors, and stashes into it again (what
    it stashes then is what the stage's backward starts from)."""

    @classmethod
    def capture(
        cls,
        inputs: Any,
        device: torch.device,
        seeds: Sequence[int] | None = None,
        scope: SkipScope | None = None,
    ) -> Replay:
        cuda = (device, torch.cuda.get_rng_state(device)) if device.type == "cuda" else None
        return cls(inputs, torch.get_rng_state(), cuda, seeds, scope=scope)

    def run(self, layers: Sequence[nn.Module], stage_index: int) -> Activation:
        devices = [self.cuda[0]] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(self.cpu_state)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])
            return run_in(self.scope, layers, self.inputs, stage_index, self.seeds)
