"""Redirect ``self(...)`` to the pipeline output, and join per-micro-batch results into one.

Inside the user's ``training_step`` on the last stage, ``self(x)`` must return the pipeline's
output for that micro-batch (the layers applied in order), not run the local copy of the whole
model. :func:`forward_returns` makes the module's ``forward`` return a given value for exactly one
call and reports any other count, which catches steps that call ``self.layers(...)`` directly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def forward_returns(module: nn.Module, output: Any, step_name: str) -> Iterator[None]:
    """Within the block, ``module(...)`` returns ``output``; exactly one call is required."""
    calls = 0

    def pipeline_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return output

    module.forward = pipeline_forward
    try:
        yield
    finally:
        del module.forward
    if calls != 1:
        raise RuntimeError(
            f"{type(module).__name__}.{step_name} called self(...) {calls} times for one micro-batch; under "
            "the pipe_tp strategy it must call it exactly once: self(...) returns the pipeline output "
            "of the micro-batch (calling self.layers(...) directly would bypass the pipeline)."
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
