"""The plan of a model's skips: which layer stashes each name, which layers pop it, and the routes
between stages that a partition gives them.

Checked once, at setup, before any work: every popped name is stashed by exactly one layer at or
before every layer that pops it. A route joins a producer stage to a later consumer stage and
carries every name the one stashes and the other pops, in one message per micro-batch (and one
gradient message back when training); a name popped on the stage that stashed it needs no route.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe.skip.layers import Rewrap, SkipDeclaration, declared_skips, unwrap


@dataclass(frozen=True)
class SkipRoute:
    """The skips stage ``producer`` stashes and the later stage ``consumer`` pops."""

    producer: int
    consumer: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class SkipPlan:
    """Per pipeline layer, what it declares; and for each name, the layer that stashes it."""

    declarations: tuple[SkipDeclaration, ...]
    stashed_by: tuple[tuple[str, int], ...]
    """Name -> index of the pipeline layer that stashes it."""

    @classmethod
    def of_layers(cls, layers: Sequence[nn.Module]) -> SkipPlan:
        """Read and check the layers' declarations (:func:`~lightning_pipe.skip.layers.declared_skips`)."""
        declarations = tuple(declared_skips(layer) for layer in layers)

        def named(k: int) -> str:
            return f"pipeline layer {k} ({type(layers[k]).__name__})"

        stashed: dict[str, int] = {}
        for k, declaration in enumerate(declarations):
            for name in declaration.stash:
                if name in stashed:
                    raise ValueError(
                        f"Skip {name!r} is stashed by {named(stashed[name])} and by {named(k)}; a name is "
                        "stashed by one layer (give the second its own name)."
                    )
                stashed[name] = k
        for k, declaration in enumerate(declarations):
            for name in declaration.pop:
                if name not in stashed:
                    raise ValueError(
                        f"{named(k)} pops skip {name!r}, which no pipeline layer stashes (stashed: "
                        f"{sorted(stashed) or 'none'}). Wrap the layer that makes it as "
                        f"Stash({name!r}, layer), or declare @skippable(stash=[{name!r}]) on the module "
                        f"that calls stash({name!r}, ...)."
                    )
                if stashed[name] > k:
                    raise ValueError(
                        f"{named(k)} pops skip {name!r} before {named(stashed[name])} stashes it; a skip "
                        "goes from a layer to a later one."
                    )
        return cls(declarations, tuple(sorted(stashed.items())))

    @property
    def empty(self) -> bool:
        return not any(self.declarations)

    def routes(self, stage_of_layer: Callable[[int], int]) -> tuple[SkipRoute, ...]:
        """The routes between stages when layer ``k`` lives on stage ``stage_of_layer(k)``."""
        between: dict[tuple[int, int], list[str]] = {}
        producer_of = dict(self.stashed_by)
        for k, declaration in enumerate(self.declarations):
            for name in declaration.pop:
                a, c = stage_of_layer(producer_of[name]), stage_of_layer(k)
                if a != c and name not in between.setdefault((a, c), []):
                    between[(a, c)].append(name)
        return tuple(SkipRoute(a, c, tuple(sorted(names))) for (a, c), names in sorted(between.items()))

    def declared_by(self, layer_indices: Sequence[int]) -> SkipDeclaration:
        """What the layers ``layer_indices`` (a stage's) declare together."""
        declaration = SkipDeclaration()
        for k in layer_indices:
            declaration = declaration | self.declarations[k]
        return declaration


@dataclass(frozen=True)
class SkipLayers:
    """A model's pipeline layers as far as skips go: the plan, and each layer's :class:`Stash` /
    :class:`Pop` wrappers to put back around the layer the executor runs."""

    plan: SkipPlan
    rewraps: tuple[Rewrap | None, ...]

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> tuple[list[nn.Module], SkipLayers]:
        """The model's own layers inside the wrappers (what the partition, checkpoints and
        tensor-parallel plans see), and the skips of ``layers``."""
        plan = SkipPlan.of_layers(layers)
        unwrapped = [unwrap(layer) for layer in layers]
        return [inner for inner, _ in unwrapped], cls(plan, tuple(rewrap for _, rewrap in unwrapped))

    def wrap(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """``layers`` (one per pipeline layer) inside their wrappers again."""
        if not self.rewraps:
            return list(layers)
        return [
            layer if rewrap is None else rewrap(layer)
            for layer, rewrap in zip(layers, self.rewraps, strict=True)
        ]
