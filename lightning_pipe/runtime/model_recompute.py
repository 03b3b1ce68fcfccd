"""A model's own activation checkpointing, taken over by the runtime's recomputation.

Hugging Face models turn theirs on with ``model.gradient_checkpointing_enable()`` (or
``activation_checkpointing_enable()``, with or without ``use_reentrant``): each decoder layer then
carries ``gradient_checkpointing = True`` and wraps its own ``forward`` in torch's checkpoint.
Inside a pipeline stage that wrapper would recompute a layer that the executor may recompute again
(with ``recompute=``), and its reentrant variant runs an autograd function of its own inside the
executor's backward, which the split backward of zero-bubble schedules cannot divide. So the
runtime takes it over: the flags are turned off (Hugging Face's wrapper then calls ``forward``
as is), and a model that asked for it is recomputed by the runtime's own mechanism
(``recompute="always"`` unless the user chose a mode), which the layout log says. The numbers
are unchanged: both recompute the same forward with the same random state.

Any module with a boolean ``gradient_checkpointing`` attribute set to ``True`` counts (the
convention of Hugging Face's ``GradientCheckpointingLayer`` and of its base models).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.runtime.options import ConfigurationError
from lightning_pipe.tensor_parallel.dropout import RegionDropout

_FLAG = "gradient_checkpointing"
_SHOWN = 3


@dataclass(frozen=True)
class ModelCheckpointing:
    """The modules of a model whose own checkpointing was on when the runtime took it over."""

    names: tuple[str, ...]
    """Their names in the module trained, in ``named_modules()`` order."""

    def merged(self, other: ModelCheckpointing | None) -> ModelCheckpointing:
        """These names and ``other``'s (a later setup may find the flags set again)."""
        if other is None:
            return self
        return ModelCheckpointing(tuple(dict.fromkeys((*self.names, *other.names))))

    def mode(self, asked: RecomputeMode) -> RecomputeMode:
        """The recomputation that honours it: the user's own mode if one was chosen, else every
        micro-batch (as the model's checkpoint recomputes every forward)."""
        return RecomputeMode.ALWAYS if asked is RecomputeMode.NEVER else asked

    def describe(self, asked: RecomputeMode) -> str:
        """The layout log's words after ``recompute <mode>``."""
        n = len(self.names)
        shown = ", ".join(self.names[:_SHOWN]) + (f" and {n - _SHOWN} more" if n > _SHOWN else "")
        why = "as the model asked" if asked is RecomputeMode.NEVER else f"recompute={asked.value!r} chosen"
        return (
            f" ({why}: its own gradient checkpointing, gradient_checkpointing_enable(), was on in "
            f"{n} module{'s' if n != 1 else ''}: {shown}; pipe_tp recomputes whole stages itself and "
            "has turned the model's checkpoint off inside them)"
        )


def take_over_checkpointing(modules: Iterable[tuple[str, nn.Module]]) -> ModelCheckpointing | None:
    """Turn off the own checkpointing of every module of ``modules`` (``named_modules()`` pairs)
    that has it on; returns which did (the repeated layers, not a base model's switch, are named
    when there are some), or ``None`` when none had it on."""
    found: list[tuple[str, nn.Module]] = [(name, m) for name, m in modules if getattr(m, _FLAG, None) is True]
    if not found:
        return None
    for _, m in found:
        setattr(m, _FLAG, False)
    # Hugging Face sets the switch on the base model too (``model.model``), which checkpoints
    # nothing itself: the layers inside it are what the user turned it on for.
    leaves = [n for n, m in found if not _holds_another(n, found)]
    return ModelCheckpointing(tuple(leaves))


def take_over_late(
    module: nn.Module, layers: Sequence[nn.Module], earlier: ModelCheckpointing | None
) -> ModelCheckpointing | None:
    """The model's own checkpointing turned on after setup (in a hook before the first training
    batch): taken over as at setup, merged with ``earlier``'s; ``None`` when none was turned on.
    Refused when ``layers`` hold tensor-parallel dropout, whose per-rank stream recomputation
    cannot replay."""
    late = take_over_checkpointing(module.named_modules())
    if late is None:
        return None
    if any(isinstance(m, RegionDropout) for layer in layers for m in layer.modules()):
        raise ConfigurationError(
            "The model's gradient checkpointing was turned on after setup, which pipe_tp honours "
            'as recompute="always", but recomputation cannot replay the per-rank random stream of '
            'tensor-parallel "dropout" layers: call gradient_checkpointing_disable(), or drop the '
            '"dropout" entries of the plan.'
        )
    return late.merged(earlier)


def _holds_another(name: str, found: Sequence[tuple[str, nn.Module]]) -> bool:
    prefix = f"{name}." if name else ""
    return any(other != name and other.startswith(prefix) for other, _ in found)
