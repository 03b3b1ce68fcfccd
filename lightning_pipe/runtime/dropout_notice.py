"""Which modules of the pipeline draw dropout, for the layout log.

A pipeline draws its random numbers on other ranks, in another order and per micro-batch, so its
dropout masks are not one device's: losses differ from step 1 (by about 1e-2 at a dropout of 0.1),
by design. That is said once, in the layout log, with the modules that draw and the option that
makes the masks the same on every layout (``layer_seeded_dropout=True``); under context
parallelism no option does yet (each rank draws its part's masks), and the line says so.

Two kinds of module draw: dropout modules (``nn.Dropout`` and its kin, the tensor-parallel
dropouts) with ``p > 0``, and modules that call functional dropout with a rate they hold as a
number, as Hugging Face attention does with ``attention_dropout`` from the model's config (any
attribute named ``*dropout*`` or ``*pdrop`` holding a positive number), or that scale their input
by random noise (a mixture of experts' router jitter, Mixtral's ``jitter_noise``: ``*jitter*``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

_SHOWN = 4


def _rate_names(module: nn.Module) -> list[str]:
    """The positive dropout rates ``module`` holds as plain numbers (``attention_dropout=0.1``,
    ``jitter_noise=0.01``)."""
    found = []
    for attr, value in vars(module).items():
        lowered = attr.lower()
        named = "dropout" in lowered or lowered.endswith("pdrop") or "jitter" in lowered
        if named and isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
            found.append(f"{attr}={value}")
    return found


def dropout_sources(module: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The modules inside ``layers`` (named as in ``module``) that draw dropout in training, each
    with its rate. A module in eval mode draws none (Lightning keeps a submodule's mode as the
    user set it, e.g. a model ``from_pretrained`` left in eval)."""
    names = {id(m): n for n, m in module.named_modules()}
    seen: set[int] = set()
    sources = []
    for layer in layers:
        for sub in layer.modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            if not sub.training:
                continue
            p = getattr(sub, "p", None)
            if "Dropout" in type(sub).__name__ and isinstance(p, float | int) and p > 0:
                sources.append(f"{names.get(id(sub), type(sub).__name__)} (p={p})")
                continue
            rates = _rate_names(sub)
            if rates:
                sources.append(f"{names.get(id(sub), type(sub).__name__)} ({', '.join(rates)})")
    return sources


def describe_dropout(sources: Sequence[str], layer_seeded: bool, context_parallel_size: int = 1) -> str:
    """The layout log's line on dropout (empty when nothing draws)."""
    if not sources:
        return ""
    n = len(sources)
    shown = ", ".join(sources[:_SHOWN]) + (f" and {n - _SHOWN} more" if n > _SHOWN else "")
    head = f"\n  dropout in training, drawn by {n} module{'s' if n != 1 else ''}: {shown}; "
    if context_parallel_size > 1:  # whether layer-seeded or not: each rank draws its part's masks
        return head + (
            f"with context_parallel_size={context_parallel_size} each rank draws the masks of its part of "
            "the sequences, so they are neither one device's nor another layout's and losses differ from "
            "one device's from the first step (set the dropout rates to 0 for an exact comparison)"
        )
    if layer_seeded:
        return head + (
            "layer-seeded (layer_seeded_dropout): the same masks on every pipeline and tensor layout "
            "(those of this model under pipe_tp on one process with the same num_microbatches), not "
            "those of a plain one-device run"
        )
    return head + (
        "its masks differ from one device's by design (drawn on other ranks, per micro-batch), so "
        "losses differ from one device's from the first step; layer_seeded_dropout=True draws the "
        "same masks on every layout"
    )
