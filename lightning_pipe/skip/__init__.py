"""Skip connections across pipeline stages: a tensor sent straight from the stage that makes it to
the stages that use it.

A layer *stashes* a named tensor and a later layer *pops* it (torchgpipe's ``@skippable``, with
the same words). The pipeline then moves it directly between the two stages, instead of threading
it through every stage in between as an extra tuple element: fewer bytes on every hop, no memory
on the stages between, and layer signatures that say what they use.

* :mod:`.scope`: :func:`stash` and :func:`pop`, called inside a layer's ``forward``, and the
  :class:`SkipScope` they act on (one per stage and micro-batch in the pipeline; a fresh one per
  call of a model outside it).
* :mod:`.layers`: how a layer declares its skips: :class:`Stash` and :class:`Pop` around an
  existing layer in ``configure_pipeline()``, or :func:`skippable` on a module that calls
  :func:`stash` / :func:`pop` itself.
* :mod:`.plan`: the checked plan of every skip (which layer stashes it, which pop it) and its
  routes between stages, which the schedule lowers into messages and the executor follows.
"""

from lightning_pipe.skip.layers import Pop, SkipDeclaration, Stash, declared_skips, skippable
from lightning_pipe.skip.plan import SkipLayers, SkipPlan, SkipRoute
from lightning_pipe.skip.scope import SkipError, SkipScope, pop, skip_scope, stash

__all__ = [
    "Pop",
    "SkipDeclaration",
    "SkipError",
    "SkipLayers",
    "SkipPlan",
    "SkipRoute",
    "SkipScope",
    "Stash",
    "declared_skips",
    "pop",
    "skip_scope",
    "skippable",
    "stash",
]
