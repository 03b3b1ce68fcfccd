"""Register ``"pipe_tp"`` with Lightning whenever Lightning is used, without importing it.

``Trainer(strategy="pipe_tp")`` looks the name up in Lightning's ``StrategyRegistry``, which is
created when ``lightning.pytorch.strategies`` is imported. ``import lightning_pipe`` must make the
name known, yet the engine (``import lightning_pipe.runtime``) must not import Lightning. So:
when Lightning's strategies are already imported, a factory is registered at once; otherwise a
finder waits for that module and registers the factory right after it has run. The factory
imports the adapter (:mod:`lightning_pipe.strategy`, by then safe: Lightning is loaded) only
when a Trainer asks for the strategy. This is the one registration: the adapter does not register
itself again (and imports nothing from here, so the two do not import each other).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

NAME = "pipe_tp"
_TARGET = "lightning.pytorch.strategies"
DESCRIPTION = "Pipeline x tensor x data parallelism from lightning_pipe"


def _make_strategy(**kwargs: Any) -> Any:
    # Imported by name, at the Trainer's request: the adapter needs the Lightning being loaded.
    adapter = importlib.import_module("lightning_pipe.strategy")
    return adapter.PipeTPStrategy(**kwargs)


def _register(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    if NAME not in registry:
        registry.register(NAME, _make_strategy, description=DESCRIPTION)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning.pytorch.strategies`` with the ordinary finders, runs it, then registers."""

    def __init__(self) -> None:
        self._loader: Any = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)


def register_with_lightning() -> None:
    """Make ``"pipe_tp"`` known to Lightning now, or as soon as Lightning's strategies load."""
    loaded = sys.modules.get(_TARGET)
    if loaded is not None and hasattr(loaded, "StrategyRegistry"):
        _register(loaded)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
