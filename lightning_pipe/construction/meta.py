"""Create a model's parameters on the meta device, and its buffers as usual.

A model too large for one process must never exist whole: every parameter created inside
:func:`parameters_on_meta` is registered as a meta tensor (shape and dtype, no storage), so each
rank later allocates only its own stage's (:mod:`~lightning_pipe.construction.materialize`).

Unlike ``with torch.device("meta")`` (what Lightning's ModelParallelStrategy uses), buffers stay
real: they are small (rotary frequencies, BatchNorm statistics, masks) and are often computed in
``__init__`` from arguments no ``reset_parameters()`` recomputes (a Hugging Face model's
``inv_freq``), so a meta buffer would lose its value. A parameter is first created where the
code asks (usually an uninitialised ``torch.empty`` on the CPU, whose pages are never touched) and
replaced by its meta twin when the module registers it, through torch's public registration
hook; the layer's own initialisation in ``__init__`` then runs on the meta twin, at no cost.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook


class ValueLostError(RuntimeError):
    """A value was assigned to a parameter that was created on the meta device."""


class _MetaTwins:
    """The registration hook: each real parameter becomes a meta twin, the same twin every time
    that parameter is registered (``w = Parameter(...); a.weight = w; b.weight = w`` stays tied).

    A real parameter registered over a module's *meta* parameter of the same name is a value
    being loaded (``from_pretrained``, ``load_state_dict(assign=True)``) or a parameter replaced
    after construction: turning it into meta would silently lose that value, so it is an error.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        # id(original) -> (a weak reference to it, its twin): the original itself is not kept alive
        # (its storage is freed at once); the reference tells a reused id from the same tensor.
        self.twins: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}

    def __call__(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None  # a tied parameter (already meta) is registered as it is, so it stays tied
        known = self.twins.get(id(param))
        if known is not None and known[0]() is param:
            return known[1]
        existing = module._parameters.get(name)
        if existing is not None and existing.is_meta:
            raise ValueLostError(
                f"{self.where} creates parameters on the meta device (no values; each rank materialises "
                f"its own stage at setup), but a value was assigned to the meta parameter {name!r} of a "
                f"{type(module).__name__}: loading weights here (from_pretrained, "
                "load_state_dict(assign=True)) or replacing a parameter after construction would be "
                "lost. Build the model from its configuration (e.g. AutoModelForCausalLM.from_config) and "
                "initialise in place (reset_parameters(), nn.init); to start from pretrained weights, give "
                "them to the strategy, which loads each rank's own stage: PipeTPStrategy(pretrained=DIR) "
                "(a save_pretrained directory or a checkpoint); or build the model in __init__ and load "
                "them there (every rank then holds the whole model)."
            )
        twin = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        twin.__dict__.update(param.__dict__)  # attributes set on the parameter (sharding marks)
        self.twins[id(param)] = (weakref.ref(param), twin)
        return twin


@contextmanager
def parameters_on_meta(where: str = "This block") -> Iterator[None]:
    """Every parameter a module registers inside the block is a meta tensor; ``where`` names the
    block in errors."""
    handle = register_module_parameter_registration_hook(_MetaTwins(where))  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` has no storage yet."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@contextmanager
def meta_tensors_set_aside(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module`` holds no meta tensors (each is registered as ``None``), so that
    whole-module moves such as the ``module.cpu()`` of Lightning's teardown skip the other stages'
    tensors, which have no storage to move."""
    aside: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
    for sub in module.modules():
        for registry in (sub._parameters, sub._buffers):
            for attr, t in registry.items():
                if t is not None and t.is_meta:
                    aside.append((registry, attr, t))  # type: ignore[arg-type]
    for registry, attr, _ in aside:
        registry[attr] = None
    try:
        yield
    finally:
        for registry, attr, t in aside:
            registry[attr] = t
