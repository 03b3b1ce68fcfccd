"""Which full module a tensor-parallel slice was cut from, for slices cut on the meta device.

A model built on the meta device is sliced before it has values: the sliced module keeps its
source (the full meta module and the function that cut it), so that materialising the slice
initialises the full module on the host and cuts it the same way
(:mod:`lightning_pipe.construction.materialize`): a slice then equals the same slice of the full
layer one device would have built.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_SOURCE = "_lightning_pipe_source"

Build = Callable[[nn.Module], nn.Module]
"""Cuts a full module into this rank's tensor-parallel module."""


def record_source(built: nn.Module, full: nn.Module, build: Build) -> None:
    """Remember that ``built`` is ``build(full)`` (a tensor-parallel slice of ``full``)."""
    built.__dict__[_SOURCE] = (full, build)


def source_of(module: nn.Module) -> tuple[nn.Module, Build] | None:
    """The full module ``module`` was cut from and how, if it was cut on the meta device."""
    found: tuple[nn.Module, Build] | None = module.__dict__.get(_SOURCE)
    return found
