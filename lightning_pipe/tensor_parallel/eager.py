"""The tensor-parallel code that ``torch.compile`` must not trace: every entry point that runs a
collective (the region boundaries, the sharded layers' ``forward``, the sequence-parallel linear
and hooks, the vocab-parallel loss) is :func:`run_eagerly`.

Dynamo cannot trace these c10d calls (asynchronous, inside custom autograd functions that keep
Python state). Left to it, a compiled layer's graph breaks at the call, the enclosing module is
run eagerly, and Dynamo compiles each sharded layer's code as a frame of its own: one code object
(``ColumnParallelLinear.forward``) shared by layers of different weight shapes, and seeing both
the whole and the split sequence, so it is compiled again for each shape (a recompilation each,
up to Dynamo's recompile limit, after which it runs eagerly anyway), for graphs of one matrix
product. Run eagerly, the layer's graph stops before the call and resumes after it, and each code
of the model is compiled once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def run_eagerly(fn: _Fn) -> _Fn:
    """``fn`` never traced by ``torch.compile`` (nor what it calls): a compiled caller breaks its
    graph at the call and runs ``fn`` as it is."""
    return cast(
        _Fn, torch.compiler.disable(fn, reason="lightning_pipe: tensor-parallel collectives run eagerly")
    )
