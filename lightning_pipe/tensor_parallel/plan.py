"""Shard a plain model with a plan: module-name patterns mapped to sharding styles.

The format is Hugging Face transformers' ``base_model_tp_plan``: keys are dotted module names
relative to the model in which ``*`` stands for one name component (``"layers.*.attn.qkv"``), values
are styles. A plan is checked completely against the whole model before anything is replaced, so
a typo or a size that does not divide fails at setup with the module's name:

=================  ==========================================  =========================
style              replaces                                     with
=================  ==========================================  =========================
``colwise``        ``nn.Linear`` (output stays sharded)         :class:`ColumnParallelLinear`
``colwise_gather`` ``nn.Linear`` (output gathered)              :class:`ColumnParallelLinear`
``colwise_logits`` ``nn.Linear`` output head: vocab-sharded     :class:`ColumnParallelLinear`,
                   logits for :func:`cross_entropy`             tagged output
``rowwise``        ``nn.Linear`` (input already sharded)        :class:`RowParallelLinear`
``rowwise_split``  ``nn.Linear`` (input replicated, split)      :class:`RowParallelLinear`
``vocab``          ``nn.Embedding``                             :class:`VocabParallelEmbedding`
``dropout``        ``nn.Dropout`` inside a sharded region       :class:`RegionDropout`
=================  ==========================================  =========================

Attention after its projections are split: a column split of a fused QKV projection keeps whole
heads only if its output features are ordered head-major (``[q0 k0 v0 | q1 k1 v1 | ...]``), and the
attention code must read its local number of heads from the projection's (local) output size,
``qkv.out_features // (3 * head_dim)``, instead of a stored head count.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.construction.materialize import record_source
from lightning_pipe.options import parse_option
from lightning_pipe.tensor_parallel.cross_entropy import tag_vocab_parallel
from lightning_pipe.tensor_parallel.dropout import RegionDropout, RegionStream
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class ShardStyle(enum.Enum):
    COLWISE = "colwise"
    COLWISE_GATHER = "colwise_gather"
    COLWISE_LOGITS = "colwise_logits"
    ROWWISE = "rowwise"
    ROWWISE_SPLIT = "rowwise_split"
    VOCAB = "vocab"
    DROPOUT = "dropout"

    @classmethod
    def parse(cls, value: str, pattern: str) -> ShardStyle:
        return parse_option(cls, value, "tensor-parallel style", context=f" for {pattern!r}")


_EXPECTED: dict[ShardStyle, type[nn.Module]] = {
    ShardStyle.COLWISE: nn.Linear,
    ShardStyle.COLWISE_GATHER: nn.Linear,
    ShardStyle.COLWISE_LOGITS: nn.Linear,
    ShardStyle.ROWWISE: nn.Linear,
    ShardStyle.ROWWISE_SPLIT: nn.Linear,
    ShardStyle.VOCAB: nn.Embedding,
    ShardStyle.DROPOUT: nn.Dropout,
}


_SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, RegionDropout)


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(
        "".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern))
    )


class _LogitsHead(ColumnParallelLinear):
    """A column-parallel output head whose vocab-sharded logits are tagged for the parallel loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tag_vocab_parallel(
            super().forward(x), self.group, dist.get_rank(self.group) * self.out_features
        )


def resolve_plan(model: nn.Module, plan: Mapping[str, str], tp_size: int) -> dict[str, ShardStyle]:
    """Match ``plan`` against ``model``: module name -> style, after checking everything.

    A pattern matches a module under *any* name it is reachable by (a Hugging Face model kept as
    ``self.llama`` and also held by pipeline wrappers ``self.pipe[i]`` is matched by
    ``"llama.model.layers.*.mlp.up_proj"`` and by ``"pipe.*.block.mlp.up_proj"``); every module is
    resolved once, under its first name in ``model.named_modules()`` order.

    Raises ``ValueError``/``TypeError`` naming the pattern or module for: an unknown style, a pattern
    that matches nothing, a style on the wrong module type, two styles for one module, a dimension
    ``tp_size`` does not divide, and an attention module with fewer heads than tensor ranks.
    """
    canonical: dict[int, str] = {}
    every_name: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            canonical.setdefault(id(module), name)
            every_name.append((name, module))
    modules = {canonical[id(m)]: m for _, m in every_name}
    resolved: dict[str, ShardStyle] = {}
    for pattern, value in plan.items():
        style = ShardStyle.parse(value, pattern)
        regex = _regex(pattern)
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
    return resolved


def _check_divisible(name: str, module: nn.Module, style: ShardStyle, tp: int) -> None:
    sizes = {
        ShardStyle.COLWISE: ("output features", getattr(module, "out_features", 0)),
        ShardStyle.COLWISE_GATHER: ("output features", getattr(module, "out_features", 0)),
        ShardStyle.COLWISE_LOGITS: ("output features (vocabulary)", getattr(module, "out_features", 0)),
        ShardStyle.ROWWISE: ("input features", getattr(module, "in_features", 0)),
        ShardStyle.ROWWISE_SPLIT: ("input features", getattr(module, "in_features", 0)),
        ShardStyle.VOCAB: ("vocabulary size (num_embeddings)", getattr(module, "num_embeddings", 0)),
    }
    if style in sizes:
        what, size = sizes[style]
        if size % tp != 0:
            raise ValueError(
                f"The {what} of {name!r} is {size}, which tensor_parallel_size={tp} does not divide. "
                f"Choose a tensor-parallel size that divides {size}, or resize the layer."
            )


def _check_heads(name: str, modules: Mapping[str, nn.Module], style: ShardStyle, tp: int) -> None:
    parent = modules.get(name.rpartition(".")[0])
    heads = getattr(parent, "num_heads", None) or getattr(parent, "n_heads", None)
    if style in (ShardStyle.COLWISE, ShardStyle.ROWWISE) and isinstance(heads, int):
        if heads < tp or heads % tp != 0:
            raise ValueError(
                f"{name.rpartition('.')[0]!r} has {heads} attention heads, which cannot be split evenly "
                f"over tensor_parallel_size={tp} ranks (each rank needs whole heads). Use a tensor size "
                f"that divides {heads}."
            )


def _builder(
    style: ShardStyle, group: dist.ProcessGroup, name: str, stream: RegionStream
) -> Callable[[nn.Module], nn.Module]:
    """The function that turns the full module ``name`` into its tensor-parallel replacement."""

    def build(module: Any) -> nn.Module:
        if style is ShardStyle.VOCAB:
            return VocabParallelEmbedding(module, group, name)
        if style is ShardStyle.DROPOUT:
            return RegionDropout(module.p, stream)
        if style is ShardStyle.COLWISE_LOGITS:
            return _LogitsHead(module, group, name=name)
        if style in (ShardStyle.COLWISE, ShardStyle.COLWISE_GATHER):
            gather = style is ShardStyle.COLWISE_GATHER
            return ColumnParallelLinear(module, group, gather_output=gather, name=name)
        return RowParallelLinear(module, group, input_is_parallel=style is ShardStyle.ROWWISE, name=name)

    return build


def apply_plan(
    model: nn.Module,
    resolved: Mapping[str, ShardStyle],
    group: dist.ProcessGroup,
    seed: int,
    include: Callable[[nn.Module], bool] = lambda module: True,
) -> list[str]:
    """Replace the resolved modules for which ``include(module)`` holds; return their names.

    ``include`` decides by the module itself, not by its name, so that a module is found however
    it is reached (see :func:`resolve_plan`); every attribute that holds it gets the replacement.

    Sharding slices the full modules' weights, so the sharded model starts where the full one is.
    """
    replaced = []
    tp_rank = dist.get_rank(group)
    stream = RegionStream(seed, tp_rank)  # one stream for all region dropouts (Megatron's tracker)
    # Parameters shared by several replaced modules (a tied embedding and head on one stage) must
    # stay shared after slicing: old parameter id -> its new shard.
    shards: dict[int, nn.Parameter] = {}
    # Every attribute that holds a module (``self.head = self.layers[-1]`` holds one twice) must
    # hold its sharded replacement, or the second name keeps the stale full module.
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for path, sub in model.named_modules(remove_duplicate=False):
        if path:
            owner, _, attr = path.rpartition(".")
            holders.setdefault(id(sub), []).append((model.get_submodule(owner) if owner else model, attr))
    for name, style in resolved.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module: Any = getattr(parent, child)
        if not include(module):
            continue
        build = _builder(style, group, name, stream)
        new = build(module)
        # A module built on the meta device is sliced on the meta device (no storage); when the
        # rank materialises it, the full module is initialised and cut by this same builder.
        if any(t.is_meta for t in module.parameters()):
            record_source(new, module, build)
        for attr in ("weight", "bias"):
            old, fresh = getattr(module, attr, None), getattr(new, attr, None)
            if isinstance(old, nn.Parameter) and isinstance(fresh, nn.Parameter):
                shared = shards.setdefault(id(old), fresh)
                if shared is not fresh and shared.shape == fresh.shape:
                    setattr(new, attr, shared)
        for holder, attr in holders.get(id(module), [(parent, child)]):
            holder._modules[attr] = new
        replaced.append(name)
    return replaced
