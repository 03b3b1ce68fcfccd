"""A tensor-parallel plan, resolved against a model and checked completely before anything is sharded.

The format is Hugging Face transformers' ``base_model_tp_plan``: keys are dotted module names
relative to the model in which ``*`` stands for one name component (``"layers.*.attn.qkv"``, see
:func:`pattern_regex`), values are styles (:mod:`.styles`). :func:`resolve_plan` matches a plan
against the whole model and checks it there, before :func:`~.apply.apply_plan` replaces anything,
so that a typo or a size that does not divide fails at setup with the module's name. It is apart
from the applier because a plan is checked once, on the whole model, while the applier replaces
only the modules of the stages this rank holds (its ``include``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_pipe.tensor_parallel.adapters import check_lora, lora_base
from lightning_pipe.tensor_parallel.dropout import RegionDropout
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle

_EXPECTED: dict[TensorParallelStyle, type[nn.Module]] = {
    TensorParallelStyle.COLWISE: nn.Linear,
    TensorParallelStyle.COLWISE_GATHER: nn.Linear,
    TensorParallelStyle.COLWISE_LOGITS: nn.Linear,
    TensorParallelStyle.ROWWISE: nn.Linear,
    TensorParallelStyle.ROWWISE_SPLIT: nn.Linear,
    TensorParallelStyle.VOCAB: nn.Embedding,
    TensorParallelStyle.DROPOUT: nn.Dropout,
    TensorParallelStyle.REPLICATED_SUM: nn.Module,
    TensorParallelStyle.SEQUENCE: nn.Module,
    TensorParallelStyle.SEQUENCE_SCATTER: nn.Module,
    TensorParallelStyle.SEQUENCE_GATHER: nn.Module,
}


def lora_region_dropouts(model: nn.Module, resolved: Mapping[str, TensorParallelStyle]) -> list[str]:
    """The LoRA dropouts of ``resolved`` that will draw from a tensor rank's own random stream
    (which activation recomputation cannot replay): an adapter's dropout on a ``rowwise`` base, which
    sees this rank's slice of the features."""
    names = []
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if style is TensorParallelStyle.ROWWISE and lora_base(module) is not None:
            dropouts: Any = getattr(module, "lora_dropout", {})
            if any(isinstance(d, nn.Dropout) and d.p > 0 for d in dropouts.values()):
                names.append(f"{name}.lora_dropout")
    return names


_LORA_STYLES = frozenset(
    {
        TensorParallelStyle.COLWISE,
        TensorParallelStyle.COLWISE_GATHER,
        TensorParallelStyle.ROWWISE,
        TensorParallelStyle.ROWWISE_SPLIT,
    }
)
"""The styles whose LoRA adapters are sliced with the base layer (see ``adapters``)."""

_SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, RegionDropout)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A plan key as a regular expression over module names (``*``: one name component); match
    with ``fullmatch``."""
    return re.compile(
        "".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern))
    )


def resolve_plan(
    model: nn.Module,
    plan: Mapping[str, str],
    tp_size: int,
    sequence_parallel: bool = False,
    split_elsewhere: bool = False,
) -> dict[str, TensorParallelStyle]:
    """Match ``plan`` against ``model``: module name -> style, after checking everything.

    A pattern matches a module under *any* name it is reachable by (a Hugging Face model kept as
    ``self.llama`` and also held by pipeline wrappers ``self.pipe[i]`` is matched by
    ``"llama.model.layers.*.mlp.up_proj"`` and by ``"pipe.*.block.mlp.up_proj"``); every module is
    resolved once, under its first name in ``model.named_modules()`` order.

    Raises ``ValueError``/``TypeError`` naming the pattern or module for: an unknown style, a pattern
    that matches nothing, a style on the wrong module type, two styles for one module, a dimension
    ``tp_size`` does not divide, and an attention module with fewer heads than tensor ranks.

    ``split_elsewhere``: under ``sequence_parallel``, the model's layer calls split the sequence
    (a Hugging Face pipeline after its vocab-parallel embedding), so the plan needs no
    ``sequence_scatter`` entry.
    """
    canonical: dict[int, str] = {}
    every_name: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            canonical.setdefault(id(module), name)
            every_name.append((name, module))
    modules = {canonical[id(m)]: m for _, m in every_name}
    resolved: dict[str, TensorParallelStyle] = {}
    for pattern, value in plan.items():
        style = TensorParallelStyle.parse(value, pattern)
        regex = pattern_regex(pattern)
        names = list(dict.fromkeys(canonical[id(m)] for n, m in every_name if regex.fullmatch(n)))
        if not names:
            leaves = [n for n, m in modules.items() if not list(m.children())][:8]
            raise ValueError(
                f"The tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__}. "
                f"Patterns are module names relative to the LightningModule, '*' standing for one name "
                f"component; some module names are {leaves}."
            )
        for name in names:
            module = modules[name]
            base = lora_base(module)
            if base is not None:  # a PEFT layer: the plan applies to the layer it wraps
                check_lora(name, module, style.value, style in _LORA_STYLES, sequence_parallel)
                module = base
            expected = _EXPECTED[style]
            if isinstance(module, _SHARDED):
                raise TypeError(
                    f"{name!r} (from {pattern!r}) is already a {type(module).__name__}: this model was "
                    "sharded before. Shard a model once, and reuse it (the pipe_tp strategy does so for "
                    "later Trainer calls), or build a fresh model to shard it again."
                )
            if not isinstance(module, expected):
                raise TypeError(
                    f"Style {style.value!r} applies to {expected.__name__} layers, but {name!r} (from "
                    f"{pattern!r}) is a {type(module).__name__}."
                )
            if resolved.get(name, style) is not style:
                raise ValueError(
                    f"The tensor-parallel plan gives {name!r} two styles, {resolved[name].value!r} and "
                    f"{style.value!r} (from {pattern!r}); give each module one style."
                )
            _check_divisible(name, module, style, tp_size)
            _check_heads(name, modules, style, tp_size)
            resolved[name] = style
    _check_tied(modules, resolved)
    _check_sequence(modules, resolved, sequence_parallel, split_elsewhere)
    return resolved


_COVERING = frozenset(
    {
        TensorParallelStyle.REPLICATED_SUM,
        TensorParallelStyle.SEQUENCE,
        TensorParallelStyle.SEQUENCE_SCATTER,
        TensorParallelStyle.SEQUENCE_GATHER,
    }
)
"""Styles whose module's parameters, and its submodules', need no sharding under sequence
parallelism: summed over the tensor group, or computed on the whole sequence."""


def _check_sequence(
    modules: Mapping[str, nn.Module],
    resolved: Mapping[str, TensorParallelStyle],
    sequence_parallel: bool,
    split_elsewhere: bool = False,
) -> None:
    """Sequence-parallel entries need ``sequence_parallel=True``; with it, the plan must say where
    the sequence is split, and every module holding parameters must be one the plan accounts for:
    between the regions each rank sees its part of the sequence only, so a parameter there (a norm
    the plan forgot) would get a partial gradient and drift apart on the tensor ranks, silently."""
    named = [n for n, style in resolved.items() if style.is_sequence]
    if not sequence_parallel:
        if named:
            raise ValueError(
                f"The tensor-parallel plan gives {named[0]!r} the sequence-parallel style "
                f"{resolved[named[0]].value!r}, which needs sequence_parallel=True; set it, or remove the "
                "sequence-parallel entries."
            )
        return
    if TensorParallelStyle.SEQUENCE_SCATTER not in resolved.values() and not split_elsewhere:
        raise ValueError(
            "sequence_parallel=True needs the tensor-parallel plan to say where the sequence is split: a "
            "'sequence_scatter' entry on the module whose output enters the first block (the embedding "
            "layer); its output is then split along the sequence (dim 1) over the tensor ranks."
        )
    whole = [
        n
        for n, style in resolved.items()
        if style in (TensorParallelStyle.SEQUENCE_SCATTER, TensorParallelStyle.SEQUENCE_GATHER)
    ]
    for name, style in resolved.items():
        if style not in (TensorParallelStyle.SEQUENCE, TensorParallelStyle.REPLICATED_SUM):
            continue
        module, where = modules[name], next((w for w in whole if name.startswith(f"{w}.")), None)
        problem = None
        # A 'replicated_sum' module inside a gathered one is a per-head norm after a column split
        # (Qwen3's q_norm): it sees the whole sequence but only this rank's heads, so its gradient
        # is partial over the heads and is summed there as without sequence parallelism.
        inside_gather = where is not None and resolved[where] is TensorParallelStyle.SEQUENCE_GATHER
        if where is not None and (style is TensorParallelStyle.SEQUENCE or not inside_gather):
            problem = (
                f"is inside {where!r} ({resolved[where].value}), where every rank sees the whole sequence "
                "and its gradients are already whole: summing them would multiply them by the tensor "
                "size. Remove the entry"
            )
        elif any(n.startswith(f"{name}.") for n in resolved):
            problem = "contains other plan entries; give the style to the norms themselves"
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            problem = (
                "is a BatchNorm, whose statistics over this rank's part of the sequence differ from "
                "the whole sequence's; put it inside a 'sequence_gather' module, or use "
                "sequence_parallel=False"
            )
        elif isinstance(module, nn.modules.dropout._DropoutNd) and type(module) is not nn.Dropout:
            problem = (
                f"is a {type(module).__name__}; only nn.Dropout draws its part of the whole sequence's mask"
            )
        if problem is not None:
            raise ValueError(f"The tensor-parallel plan entry {name!r}: {style.value!r} {problem}.")
    covering = [n for n, style in resolved.items() if style in _COVERING]

    def computes_per_part(module: nn.Module) -> bool:
        """Would compute otherwise on a part of the sequence than on the whole (a parameter's
        gradient, a dropout's draws, a BatchNorm's statistics)."""
        return (
            any(p is not None for p in module._parameters.values())
            or isinstance(module, nn.modules.batchnorm._BatchNorm)
            or (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
        )

    uncovered = [
        name
        for name, module in modules.items()
        if computes_per_part(module)
        and name not in resolved
        and not any(name.startswith(f"{c}.") for c in covering)
    ]
    if uncovered:
        shown = ", ".join(repr(n) for n in uncovered[:5])
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise ValueError(
            f"Under sequence_parallel=True each tensor rank holds only its part of the sequence between "
            f"the tensor-parallel layers, where a module with parameters would get a partial gradient, a "
            f"dropout would draw another mask and a BatchNorm other statistics than on the whole "
            f"sequence; the plan does not account for {shown}{more}. Give a norm or an nn.Dropout there the "
            "style 'sequence' (a norm's gradients are summed over the tensor group; a dropout applies its "
            "part of the whole sequence's mask; a dropout inside a tensor-parallel region, between a "
            "column and a row layer, takes 'dropout'), or put the module inside a 'sequence_gather' module "
            "(it sees the whole sequence) or the 'sequence_scatter' module (before the split)."
        )


# The dim of a module's weight that each style splits.
_WEIGHT_DIM = {
    TensorParallelStyle.COLWISE: 0,
    TensorParallelStyle.COLWISE_GATHER: 0,
    TensorParallelStyle.COLWISE_LOGITS: 0,
    TensorParallelStyle.ROWWISE: 1,
    TensorParallelStyle.ROWWISE_SPLIT: 1,
    TensorParallelStyle.VOCAB: 0,
}


def _check_tied(modules: Mapping[str, nn.Module], resolved: Mapping[str, TensorParallelStyle]) -> None:
    """A weight held by several modules (an output head tied to the token embedding) must be split
    the same way in all of them, or the copies would stop being one tensor."""
    holders: dict[int, list[str]] = {}
    for name, module in modules.items():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(name)
    for names in holders.values():
        if len(names) < 2 or not any(n in resolved for n in names):
            continue
        unsharded = [n for n in names if n not in resolved]
        sharded = [n for n in names if n in resolved]
        if unsharded:
            raise ValueError(
                f"{sharded[0]!r} and {unsharded[0]!r} share a weight (tied), but the tensor-parallel plan "
                f"shards only {sharded[0]!r} ({resolved[sharded[0]].value!r}). Shard {unsharded[0]!r} the "
                "same way: an embedding tied to a column-parallel head takes 'vocab' (Hugging Face: "
                "'embedding_rowwise'), a head tied to a vocab-parallel embedding a column style "
                "('colwise_logits', or Hugging Face's 'colwise_gather_output')."
            )
        dims = {n: _WEIGHT_DIM.get(resolved[n]) for n in sharded}
        if len(set(dims.values())) > 1:
            (a, da), (b, db) = list(dims.items())[:2]
            raise ValueError(
                f"{a!r} and {b!r} share a weight (tied), but the plan splits it along dim {da} for {a!r} "
                f"({resolved[a].value}) but dim {db} for {b!r} ({resolved[b].value}). Give them styles that "
                "split the same dim: 'vocab' for the embedding with a column style for the head."
            )


def _check_divisible(name: str, module: nn.Module, style: TensorParallelStyle, tp: int) -> None:
    sizes = {
        TensorParallelStyle.COLWISE: ("output features", getattr(module, "out_features", 0)),
        TensorParallelStyle.COLWISE_GATHER: ("output features", getattr(module, "out_features", 0)),
        TensorParallelStyle.COLWISE_LOGITS: (
            "output features (vocabulary)",
            getattr(module, "out_features", 0),
        ),
        TensorParallelStyle.ROWWISE: ("input features", getattr(module, "in_features", 0)),
        TensorParallelStyle.ROWWISE_SPLIT: ("input features", getattr(module, "in_features", 0)),
        TensorParallelStyle.VOCAB: ("vocabulary size (num_embeddings)", getattr(module, "num_embeddings", 0)),
    }
    if style in sizes:
        what, size = sizes[style]
        if size % tp != 0:
            raise ValueError(
                f"The {what} of {name!r} is {size}, which tensor_parallel_size={tp} does not divide. "
                f"Choose a tensor-parallel size that divides {size}, or resize the layer."
            )


def _check_heads(name: str, modules: Mapping[str, nn.Module], style: TensorParallelStyle, tp: int) -> None:
    parent = modules.get(name.rpartition(".")[0])
    heads = getattr(parent, "num_heads", None) or getattr(parent, "n_heads", None)
    if style in (TensorParallelStyle.COLWISE, TensorParallelStyle.ROWWISE) and isinstance(heads, int):
        if heads < tp or heads % tp != 0:
            raise ValueError(
                f"{name.rpartition('.')[0]!r} has {heads} attention heads, which cannot be split evenly "
                f"over tensor_parallel_size={tp} ranks (each rank needs whole heads). Use a tensor size "
                f"that divides {heads}."
            )
