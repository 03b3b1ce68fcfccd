"""How a pipeline layer declares the skips it stashes and pops.

The plan of every skip must be known before anything runs (the schedule holds a message for each
route between stages), so a layer's skips are declared, not discovered. Two ways:

* :class:`Stash` and :class:`Pop` around a layer in ``configure_pipeline()``, for models whose
  ``forward`` passes the skips itself (a U-Net's ``forward`` keeps ``x1`` and hands it to the up
  block): the layers stay as they are, ``Stash("x1", self.inc)`` stashes ``inc``'s output and
  ``Pop("x1", self.up2)`` calls ``up2(x, x1)``. The wrappers hold no parameters: checkpoints,
  partitions and tensor-parallel plans see the layer inside.
* :func:`skippable` on a module whose ``forward`` calls :func:`~lightning_pipe.skip.scope.stash`
  and :func:`~lightning_pipe.skip.scope.pop` itself (torchgpipe's ``@skippable``): on its class,
  when every instance uses the same names, or on one instance, when each has its own.

A pipeline layer declares the union of what its wrappers and every module inside it declare.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_pipe.skip.scope import SkipError, pop, stash

_ATTRIBUTE = "_lightning_pipe_skips"
T = TypeVar("T")


def _names(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Skip names to {what} must be non-empty strings, got {name!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"The names to {what} repeat: {list(names)}.")
    return names


@dataclass(frozen=True)
class SkipDeclaration:
    """The names a layer stashes and the names it pops."""

    stash: tuple[str, ...] = ()
    pop: tuple[str, ...] = ()

    def __or__(self, other: SkipDeclaration) -> SkipDeclaration:
        return SkipDeclaration(
            tuple(dict.fromkeys((*self.stash, *other.stash))), tuple(dict.fromkeys((*self.pop, *other.pop)))
        )

    def __bool__(self) -> bool:
        return bool(self.stash or self.pop)


def skippable(
    target: T | None = None, *, stash: str | Sequence[str] = (), pop: str | Sequence[str] = ()
) -> Any:
    """Declare that a module's ``forward`` stashes and pops these names.

    As a class decorator (``@skippable(stash=["x1"])``) every instance declares them; called on an
    instance (``skippable(block, pop="x1")``, which returns ``block``) only that one does, so that
    the blocks of one class can each use their own name.
    """
    declaration = SkipDeclaration(_names(stash, "stash"), _names(pop, "pop"))

    def apply(obj: T) -> T:
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            setattr(obj, _ATTRIBUTE, declaration)
        elif isinstance(obj, nn.Module):
            # Not a module attribute nn.Module tracks (no parameters, not in state_dict).
            object.__setattr__(obj, _ATTRIBUTE, declaration)
        else:
            raise TypeError(f"skippable() declares skips of an nn.Module class or instance, not {obj!r}.")
        return obj

    return apply(target) if target is not None else apply


def declared_skips(layer: nn.Module) -> SkipDeclaration:
    """What ``layer`` and every module inside it declare."""
    declaration = SkipDeclaration()
    for module in layer.modules():
        own = getattr(module, _ATTRIBUTE, None)
        if own is not None:
            declaration = declaration | own
    return declaration


class Stash(nn.Module):
    """``layer``, whose output is also stashed under ``name`` (``output=k``: element ``k`` of a
    tuple output)."""

    def __init__(self, name: str, layer: nn.Module, *, output: int | None = None) -> None:
        super().__init__()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"Stash({name!r}, layer) wraps a module, got {type(layer).__name__}.")
        self.layer = layer
        self.name = _names(name, "stash")[0]
        self.output = output
        object.__setattr__(self, _ATTRIBUTE, SkipDeclaration(stash=(self.name,)))

    def forward(self, *args: Any) -> Any:
        out = self.layer(*args)
        picked = out[self.output] if self.output is not None and isinstance(out, tuple) else out
        if not isinstance(picked, torch.Tensor):
            raise SkipError(
                f"Stash({self.name!r}, {type(self.layer).__name__}) needs a tensor to stash, but the layer "
                f"returned {type(out).__name__}; with a tuple output, say which element: output=k."
            )
        stash(self.name, picked)
        return out

    def extra_repr(self) -> str:
        return f"name={self.name!r}" + (f", output={self.output}" if self.output is not None else "")


class Pop(nn.Module):
    """``layer`` called with the tensors stashed under ``names`` after its positional arguments
    (``keywords=True``: as keyword arguments named like the skips)."""

    def __init__(self, names: str | Sequence[str], layer: nn.Module, *, keywords: bool = False) -> None:
        super().__init__()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"Pop({names!r}, layer) wraps a module, got {type(layer).__name__}.")
        self.layer = layer
        self.names = _names(names, "pop")
        self.keywords = keywords
        object.__setattr__(self, _ATTRIBUTE, SkipDeclaration(pop=self.names))

    def forward(self, *args: Any) -> Any:
        tensors = [pop(name) for name in self.names]
        if self.keywords:
            return self.layer(*args, **dict(zip(self.names, tensors, strict=True)))
        return self.layer(*args, *tensors)

    def extra_repr(self) -> str:
        return f"names={list(self.names)}" + (", keywords=True" if self.keywords else "")


Rewrap = Callable[[nn.Module], nn.Module]
"""Puts a layer's :class:`Stash` / :class:`Pop` wrappers back around another module (the layer
as the executor runs it: tensor-parallel slices, a bound call)."""


def unwrap(layer: nn.Module) -> tuple[nn.Module, Rewrap | None]:
    """The model's layer inside ``layer``'s wrappers, and how to put the wrappers around another
    module (``None`` when there are none)."""
    wrappers: list[Stash | Pop] = []
    while isinstance(layer, Stash | Pop):
        wrappers.append(layer)
        layer = layer.layer
    if not wrappers:
        return layer, None

    def rewrap(inner: nn.Module) -> nn.Module:
        for wrapper in reversed(wrappers):
            if isinstance(wrapper, Stash):
                inner = Stash(wrapper.name, inner, output=wrapper.output)
            else:
                inner = Pop(wrapper.names, inner, keywords=wrapper.keywords)
        return inner

    return layer, rewrap
