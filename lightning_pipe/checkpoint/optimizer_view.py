"""An optimizer that holds only this rank's parameters, described in whole-model terms.

``configure_optimizers`` is written the usual way, ``self.parameters()`` (or parameter groups),
so the optimizer it returns lists every stage's parameters. Under ``pipe_tp`` each optimizer keeps
only this rank's (:func:`keep_own`), but remembers, per parameter group, the names of all the
parameters that group had: checkpoints number optimizer state as one device would
(``state_dict()`` indices over the whole model's groups), so that any layout, and one device,
can read them. :func:`whole_model_names` gives those names; :func:`local_to_whole` maps this
rank's indices into them.
"""

from __future__ import annotations

import copy
from collections.abc import Set

import torch
from torch import nn

_WHOLE = "_lightning_pipe_whole_names"


def keep_own(optimizer: torch.optim.Optimizer, module: nn.Module, own: Set[int]) -> None:
    """Drop from ``optimizer``'s groups every parameter whose ``id()`` is not in ``own``, after
    recording each group's names (a group may become empty: its options still apply, and
    LR schedulers keep one entry per group)."""
    setattr(optimizer, _WHOLE, _group_names(optimizer, module))
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in own]


def whole_model_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[str]]:
    """Per parameter group, the names of the whole model's parameters in it (this rank's only, for
    an optimizer :func:`keep_own` never saw)."""
    whole: list[list[str]] | None = getattr(optimizer, _WHOLE, None)
    if whole is not None:
        return whole
    return _group_names(optimizer, module)


def _group_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[str]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(group["params"])]
        for group in optimizer.param_groups
    ]


def local_to_whole(optimizer: torch.optim.Optimizer, module: nn.Module, local_names: list[str]) -> list[int]:
    """For each of this rank's parameters (flat, by ``local_names``), its index in the whole
    model's flat numbering; parameters are found by name within their own group."""
    whole = whole_model_names(optimizer, module)
    out, offset, position = [], 0, 0
    for group, names in zip(optimizer.param_groups, whole, strict=True):
        where = {name: offset + i for i, name in enumerate(names)}
        for name in local_names[position : position + len(group["params"])]:
            out.append(where[name])
        position += len(group["params"])
        offset += len(names)
    return out


def local_groups(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> list[dict]:
    """Copies of ``saved_groups`` (their options) with ``params`` numbered over this rank's
    optimizer: what its ``load_state_dict`` takes."""
    out, position = [], 0
    for group, theirs in zip(optimizer.param_groups, saved_groups, strict=True):
        options = copy.deepcopy({k: v for k, v in theirs.items() if k != "params"})
        out.append({**options, "params": list(range(position, position + len(group["params"])))})
        position += len(group["params"])
    return out


def whole_groups(optimizer: torch.optim.Optimizer, module: nn.Module, saved_groups: list[dict]) -> list[dict]:
    """``saved_groups`` (an ``optimizer.state_dict()``'s) with ``params`` numbered over the whole
    model's groups."""
    whole = whole_model_names(optimizer, module)
    out, offset = [], 0
    for group, names in zip(saved_groups, whole, strict=True):
        out.append({**group, "params": list(range(offset, offset + len(names)))})
        offset += len(names)
    return out
