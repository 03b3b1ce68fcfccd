"""What the setup checks and the model's answer inside a step read from a derived pipeline.

:class:`~lightning_pipe.huggingface.pipeline.CausalLMPipeline` calls the checks
(:mod:`~lightning_pipe.huggingface.check`, :mod:`~lightning_pipe.huggingface.sequence_check`) with
itself, and :class:`~lightning_pipe.huggingface.outputs.ModelCall` holds it; they read it through
this protocol, so that none of them imports the pipeline back (not even for a type).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from lightning_pipe.execution.layers import LayerCall
from lightning_pipe.huggingface.balancing import BalancingLoss
from lightning_pipe.huggingface.context import LayerContext
from lightning_pipe.huggingface.parts import CausalLMParts


class PipelineView(Protocol):
    """A causal LM's derived pipeline, as the checks and the model call see it."""

    @property
    def parts(self) -> CausalLMParts:
        """The model's parts, in its plan's order."""

    @property
    def model(self) -> nn.Module:
        """The causal LM."""

    @property
    def context(self) -> LayerContext:
        """The masks and rotary tables the decoder layers' calls rebuild (forgotten between runs)."""

    @property
    def balancing(self) -> BalancingLoss | None:
        """The router's load-balancing loss the model adds, carried along the pipeline (or ``None``)."""

    def calls(self) -> list[LayerCall]:
        """How each pipeline layer is called, in order."""

    def decoder_call(self, index: int) -> LayerCall:
        """How decoder layer ``index`` is called."""

    def pipeline_input(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A (micro-)batch's ``(input_ids, attention_mask, position_ids)``."""
