"""The tensor-parallel code that ``torch.compile`` must not trace: the sharded layers' ``forward``
and the sequence-parallel hooks, which run the collectives, are run eagerly
(:func:`keep_eager_under_compile`).

Dynamo cannot trace these c10d calls (asynchronous, inside custom autograd functions that keep
Python state). Left to it, a compiled layer's graph breaks at the call, the enclosing module is
run eagerly, and Dynamo compiles each sharded layer's code as a frame of its own: one code object
(``ColumnParallelLinear.forward``) shared by layers of different weight shapes, and seeing both
the whole and the split sequence, so it is compiled again for each shape (a recompilation each,
up to Dynamo's recompile limit, after which it runs eagerly anyway), for graphs of one matrix
product. Run eagerly (``torch.compiler.disable``, which covers what they call), the layer's graph
stops before each and resumes after it, and each code of the model is compiled once.

The classes are marked here (:func:`eager_under_compile`) and disabled when a runtime is built
with compiled layers, not at import: ``torch.compiler.disable`` imports Dynamo, about 2 s of CPU
that a process which never compiles (an engine-only rank) need not pay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_C = TypeVar("_C", bound=type)

_MARKED: list[tuple[type, str]] = []
"""The classes and the method of each that runs eagerly under ``torch.compile``."""

_DONE: set[tuple[type, str]] = set()


def eager_under_compile(method: str) -> Callable[[_C], _C]:
    """Class decorator: the class's ``method`` (a ``forward``, a hook's ``__call__``) runs eagerly
    under ``torch.compile`` once :func:`keep_eager_under_compile` ran."""

    def mark(cls: _C) -> _C:
        _MARKED.append((cls, method))
        return cls

    return mark


def keep_eager_under_compile() -> None:
    """Disable ``torch.compile`` in every marked method (once; instances made before included)."""
    for cls, method in _MARKED:
        if (cls, method) not in _DONE:
            disabled = torch.compiler.disable(
                vars(cls)[method], reason="lightning_pipe: tensor-parallel collectives run eagerly"
            )
            setattr(cls, method, disabled)
            _DONE.add((cls, method))
