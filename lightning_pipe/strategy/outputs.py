"""Redirect the model's call inside a step to the pipeline output, and join per-micro-batch results.

Inside the user's ``training_step`` on the last stage, ``self(x)`` must return the pipeline's
output for that micro-batch (the layers applied in order), not run the local copy of the whole
model. :func:`forward_returns` makes a module's ``forward`` answer exactly one call with a reply
built from the pipeline output, and reports any other count, which catches steps that call
``self.layers(...)`` directly. The module is the LightningModule itself, or the Hugging Face model
whose pipeline was derived (``self.model(**batch)`` then answers with the pipeline's logits and
the loss of the micro-batch's labels; see :mod:`lightning_pipe.huggingface.outputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def forward_returns(
    module: nn.Module, reply: Callable[..., Any], step_name: str, call: str = "self(...)"
) -> Iterator[None]:
    """Within the block, ``module(...)`` returns ``reply(*args, **kwargs)``; exactly one call is
    required (``call``: how the step writes it, for the message)."""
    calls = 0

    def pipeline_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return reply(*args, **kwargs)

    module.forward = pipeline_forward
    try:
        yield
    finally:
        del module.forward
    if calls != 1:
        raise RuntimeError(
            f"{step_name} called {call} {calls} times for one micro-batch; under the pipe_tp strategy it "
            f"must call it exactly once: {call} returns the pipeline output of the micro-batch (calling "
            "the layers directly would bypass the pipeline)."
        )


def concat_outputs(outputs: list[Any]) -> Any:
    """Join per-micro-batch outputs along dim 0, recursing into tuples, lists and dicts.

    Scalars (0-dim tensors) and non-tensor leaves cannot be joined along a batch dimension and
    are returned as the list of the micro-batches' values.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(outputs)
        return torch.cat(outputs, dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: concat_outputs([o[k] for o in outputs]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, tuple | list):
        joined = [concat_outputs([o[i] for o in outputs]) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*joined)
        return type(first)(joined)
    if first is None and all(o is None for o in outputs):
        return None
    return list(outputs)
