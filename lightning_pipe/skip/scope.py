""":func:`stash` and :func:`pop`: the two calls a layer's ``forward`` makes, and the scope they act on.

Inside the pipeline, the executor runs each stage's forward of a micro-batch in its own
:class:`SkipScope`: ``popped`` holds what this stage may pop (received from the stage that stashed
it, or stashed earlier on this rank), ``stashed`` collects what the stage's layers stash, which the
executor sends on. Outside a pipeline (the model's own ``forward`` on one device, a plain
``nn.Sequential`` of the layers) there is no executor: the calls then use a scope of this thread
that lives until the next stash of the same name, as torchgpipe's skip tracker does; wrap a call
in :func:`skip_scope` to give it a fresh one that holds nothing afterwards.

The scope is a :class:`contextvars.ContextVar`, so a recomputed forward (torch's checkpoint runs
the layers again inside backward) re-enters the scope it was given rather than whatever is
current then.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager

import torch


class SkipError(RuntimeError):
    """A stash or pop that the declarations do not allow, or a pop with nothing stashed."""


class SkipScope:
    """What one forward (one stage's, for one micro-batch) may pop and what it stashed.

    Args:
        popped: the tensors this forward may pop, by name.
        may_stash: the names this forward's layers declared they stash (``None``: any name, the
            scope of a model run outside a pipeline).
        may_pop: the names they declared they pop (``None``: any).
        where: who runs in this scope, for error messages ("pipeline stage 2").
        overwrite: a second stash of a name replaces the first (the per-thread scope outside a
            pipeline, which lives across forwards) instead of being refused.
    """

    def __init__(
        self,
        popped: Mapping[str, torch.Tensor] | None = None,
        may_stash: Collection[str] | None = None,
        may_pop: Collection[str] | None = None,
        where: str = "this forward",
        overwrite: bool = False,
    ) -> None:
        self.popped: dict[str, torch.Tensor] = dict(popped or {})
        self.stashed: dict[str, torch.Tensor] = {}
        self.may_stash = None if may_stash is None else frozenset(may_stash)
        self.may_pop = None if may_pop is None else frozenset(may_pop)
        self.where = where
        self._overwrite = overwrite

    @contextmanager
    def active(self) -> Iterator[SkipScope]:
        """Make this the scope of :func:`stash` and :func:`pop` inside the block; each entry starts
        with nothing stashed (a recomputed forward stashes again, into a fresh dict)."""
        self.stashed = {}
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise SkipError(
                f"stash({name!r}, ...) in {self.where} got {type(tensor).__name__}, not a tensor."
            )
        self._check_declared(name, self.may_stash, "stash", "knows where to send it")
        if name in self.stashed and not self._overwrite:
            raise SkipError(
                f"{name!r} was stashed twice in {self.where}; each name is stashed once per forward "
                "(give the second its own name)."
            )
        self.stashed[name] = tensor

    def _check_declared(self, name: str, declared: frozenset[str] | None, verb: str, why: str) -> None:
        """Refuse a ``verb`` ("stash" or "pop") of a name this scope's layers do not declare."""
        if declared is None or name in declared:
            return
        done = "stashed" if verb == "stash" else "popped"
        wrapper = "Stash" if verb == "stash" else "Pop"
        raise SkipError(
            f"A layer of {self.where} {done} {name!r}, which none of its layers declares (declared: "
            f"{sorted(declared) or 'none'}). Declare it, so that the pipeline {why}: wrap the layer as "
            f"{wrapper}({name!r}, layer) in configure_pipeline(), or decorate its module with "
            f"@skippable({verb}=[{name!r}])."
        )

    def pop(self, name: str) -> torch.Tensor:
        self._check_declared(name, self.may_pop, "pop", "sends it here")
        if name in self.stashed:
            return self.stashed[name]
        if name in self.popped:
            return self.popped[name]
        raise SkipError(
            f"pop({name!r}) in {self.where}: nothing was stashed under that name before it (stashed "
            f"so far: {sorted({*self.stashed, *self.popped}) or 'nothing'}). A layer must stash({name!r}, "
            "tensor) earlier in the same forward."
        )


_CURRENT: contextvars.ContextVar[SkipScope | None] = contextvars.ContextVar("lightning_pipe_skip_scope")
_THREAD = threading.local()


def _current() -> SkipScope:
    scope = _CURRENT.get(None)
    if scope is not None:
        return scope
    default = getattr(_THREAD, "scope", None)
    if default is None:  # outside any pipeline and any skip_scope(): this thread's own
        default = _THREAD.scope = SkipScope(where="a forward outside the pipeline", overwrite=True)
    return default


def stash(name: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer's :func:`pop` (call inside ``forward``)."""
    _current().stash(name, tensor)


def pop(name: str) -> torch.Tensor:
    """The tensor an earlier layer stashed under ``name`` in this forward (call inside
    ``forward``). Several layers may pop one name: each gets the same tensor."""
    return _current().pop(name)


@contextmanager
def skip_scope() -> Iterator[SkipScope]:
    """A fresh scope for a model run outside the pipeline: what is stashed inside is dropped at
    the end of the block (without it, this thread's scope keeps the last tensor of each name)."""
    with SkipScope(where="this forward").active() as scope:
        yield scope
