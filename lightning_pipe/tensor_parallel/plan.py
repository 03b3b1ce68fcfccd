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
``replicated_sum`` any module, kept whole; its gradients         (nothing)
                   summed over the tensor group
=================  ==========================================  =========================

``replicated_sum`` (Hugging Face's ``replicated_with_grad_allreduce``) is for a module that stays
whole on every tensor rank but sees only this rank's slice of its input: a per-head norm of the
queries and keys (Qwen3's ``q_norm``/``k_norm``) after a column split of the projections. Each rank's
gradient then covers its own heads only; the sum over the tensor group is the whole gradient, which
the runtime takes after backward, before clipping and the optimizer step. (Without the entry the
copies would drift apart, silently.)

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

from lightning_pipe.arguments import parse_option
from lightning_pipe.tensor_parallel.adapters import adapter_parts, check_lora, lora_base
from lightning_pipe.tensor_parallel.cross_entropy import tag_vocab_parallel
from lightning_pipe.tensor_parallel.dropout import RegionDropout, RegionStream, SequenceDropout
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_pipe.tensor_parallel.regions import (
    GatheredGradient,
    gather_from_sequence,
    scatter_to_sequence,
    sequence_active,
)
from lightning_pipe.tensor_parallel.sequence_linear import gather_for_module
from lightning_pipe.tensor_parallel.sources import record_source


class TensorParallelStyle(enum.Enum):
    COLWISE = "colwise"
    COLWISE_GATHER = "colwise_gather"
    COLWISE_LOGITS = "colwise_logits"
    ROWWISE = "rowwise"
    ROWWISE_SPLIT = "rowwise_split"
    VOCAB = "vocab"
    DROPOUT = "dropout"
    REPLICATED_SUM = "replicated_sum"
    SEQUENCE = "sequence"
    SEQUENCE_SCATTER = "sequence_scatter"
    SEQUENCE_GATHER = "sequence_gather"

    @property
    def is_column(self) -> bool:
        """A column-parallel layer (it multiplies a whole input; under sequence parallelism it
        gathers the sequence or is inside a module that does)."""
        return self in (
            TensorParallelStyle.COLWISE,
            TensorParallelStyle.COLWISE_GATHER,
            TensorParallelStyle.COLWISE_LOGITS,
        )

    @property
    def is_sequence(self) -> bool:
        """A style that only sequence parallelism gives a meaning to."""
        return self in _SEQUENCE_STYLES

    @classmethod
    def parse(cls, value: str, pattern: str) -> TensorParallelStyle:
        """Our style names, or Hugging Face's as its plans write them (``model._tp_plan``,
        ``config.base_model_tp_plan``); a Hugging Face style we do not implement is refused with
        what to do instead."""
        if isinstance(value, str) and value.lower() in HF_STYLES:
            return HF_STYLES[value.lower()]
        if isinstance(value, str):
            why = next((text for names, text in _HF_UNSUPPORTED if value.lower() in names), None)
            if why is not None:
                raise ValueError(
                    f"The tensor-parallel plan entry {pattern!r}: {value!r} is a Hugging Face style that "
                    f"pipe_tp does not support: {why}."
                )
        hint = f" (or Hugging Face's {', '.join(repr(n) for n in HF_STYLES)})"
        return parse_option(cls, value, "tensor-parallel style", context=f" for {pattern!r}", hint=hint)


_SEQUENCE_STYLES = frozenset(
    {TensorParallelStyle.SEQUENCE, TensorParallelStyle.SEQUENCE_SCATTER, TensorParallelStyle.SEQUENCE_GATHER}
)

# Hugging Face transformers' style names (5.x), as its models' plans write them, mapped to ours;
# "colwise" and "rowwise" are the same words in both.
HF_STYLES: dict[str, TensorParallelStyle] = {
    "colwise_gather_output": TensorParallelStyle.COLWISE_GATHER,
    "colwise_rep": TensorParallelStyle.COLWISE_GATHER,
    "rowwise_split_input": TensorParallelStyle.ROWWISE_SPLIT,
    "rowwise_rep": TensorParallelStyle.ROWWISE_SPLIT,
    "embedding_rowwise": TensorParallelStyle.VOCAB,
    "replicated_with_grad_allreduce": TensorParallelStyle.REPLICATED_SUM,
    "sequence_parallel": TensorParallelStyle.SEQUENCE,
}

_HF_UNSUPPORTED: tuple[tuple[frozenset[str], str], ...] = (
    (
        frozenset({"replicate"}),
        "remove the entry: every module the plan does not name stays whole (replicated) on every tensor "
        "rank; one that sees only this rank's slice of its input (a per-head norm after a column split) "
        "takes 'replicated_sum' (Hugging Face: 'replicated_with_grad_allreduce') instead",
    ),
    (
        frozenset(
            {"local_colwise", "local_rowwise", "local", "local_packed_rowwise", "local_params", "gather"}
        ),
        "Hugging Face's local styles leave the communication to the model's own code; use 'colwise', "
        "'rowwise' or 'colwise_gather_output' instead, which pipe_tp implements with their communication",
    ),
    (
        frozenset({"packed_colwise", "packed_rowwise"}),
        "a fused projection (gate and up in one Linear) must be split per half, which pipe_tp cannot do "
        "yet; leave it out of the plan (it stays whole) or build it as two Linear layers",
    ),
    (
        frozenset(
            {"grouped_gemm", "ep_router", "ep_dispatch_experts", "moe_tp_experts", "isolated"}
            | {"mla_kv_a_proj"}
        ),
        "expert parallelism and model-specific styles are not supported; leave these modules out of the "
        "plan (they stay whole on every tensor rank)",
    ),
)


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


def _builder(
    style: TensorParallelStyle, group: dist.ProcessGroup, name: str, stream: RegionStream, sequence: str
) -> Callable[[nn.Module], nn.Module]:
    """The function that turns the full module ``name`` into its tensor-parallel replacement
    (``sequence``: ``"none"``, or under sequence parallelism how a column-parallel layer receives
    the sequence, ``"shard"`` or ``"gathered"``)."""

    def build(module: Any) -> nn.Module:
        if style is TensorParallelStyle.VOCAB:
            return VocabParallelEmbedding(module, group, name)
        if style is TensorParallelStyle.DROPOUT:
            return RegionDropout(module.p, stream)
        if style is TensorParallelStyle.SEQUENCE:  # an nn.Dropout between the regions
            return SequenceDropout(module.p, group)
        column: ColumnParallelLinear | None = None
        if style is TensorParallelStyle.COLWISE_LOGITS:
            column = _LogitsHead(module, group, name=name)
        elif style in (TensorParallelStyle.COLWISE, TensorParallelStyle.COLWISE_GATHER):
            gather = style is TensorParallelStyle.COLWISE_GATHER
            column = ColumnParallelLinear(module, group, gather_output=gather, name=name)
        if column is not None:
            column.sequence_input = sequence
            return column
        row = RowParallelLinear(
            module, group, input_is_parallel=style is TensorParallelStyle.ROWWISE, name=name
        )
        row.sequence_output = sequence != "none"
        return row

    return build


def _sequence_hooks(
    module: nn.Module, style: TensorParallelStyle, group: dist.ProcessGroup, has_columns: bool
) -> None:
    """A ``sequence_scatter`` module splits its output along the sequence; a ``sequence_gather``
    module gathers its (first) input, so that what it computes sees the whole sequence: for its
    column-parallel layers, which save only this rank's part, and whose partial gradients the
    gather's backward reduce-scatters (``has_columns``), or for layers computed whole only (a head:
    the gradient is equal on every rank, and its backward keeps this rank's part)."""
    if style is TensorParallelStyle.SEQUENCE_SCATTER:

        def scatter(_: nn.Module, args: Any, output: Any) -> Any:
            if not sequence_active():
                return output
            if isinstance(output, tuple):
                return (scatter_to_sequence(output[0], group), *output[1:])
            return scatter_to_sequence(output, group)

        module.register_forward_hook(scatter)
        return

    def gathered(x: torch.Tensor) -> torch.Tensor:
        if has_columns:
            return gather_for_module(x, group)
        return gather_from_sequence(x, group, GatheredGradient.EQUAL)

    def gather(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not sequence_active():
            return None
        if args:
            return (gathered(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": gathered(kwargs["hidden_states"])}
        raise TypeError(
            "A 'sequence_gather' module was called without a positional input or hidden_states=; "
            "it gathers its first input along the sequence."
        )

    module.register_forward_pre_hook(gather, with_kwargs=True)


def apply_plan(
    model: nn.Module,
    resolved: Mapping[str, TensorParallelStyle],
    group: dist.ProcessGroup,
    seed: int,
    include: Callable[[nn.Module], bool] = lambda module: True,
    sequence_parallel: bool = False,
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
    gathering = [n for n, style in resolved.items() if style is TensorParallelStyle.SEQUENCE_GATHER]

    def replace(
        module: nn.Module, build: Callable[[nn.Module], nn.Module], owner: nn.Module, attr: str
    ) -> None:
        """Replace ``module`` (held by ``owner.attr``, and by every other attribute holding it) by
        ``build(module)``."""
        new = build(module)
        # A fresh module is in train mode; it takes the mode of the one it replaces (a model loaded
        # by from_pretrained is in eval mode, and must stay all eval, as on one device).
        new.train(module.training)
        # A module built on the meta device is sliced on the meta device (no storage); when the
        # rank materialises it, the full module is initialised and cut by this same builder.
        if any(t.is_meta for t in module.parameters()):
            record_source(new, module, build)
        for weight in ("weight", "bias"):
            old, fresh = getattr(module, weight, None), getattr(new, weight, None)
            if isinstance(old, nn.Parameter) and isinstance(fresh, nn.Parameter):
                shared = shards.setdefault(id(old), fresh)
                if shared is not fresh and shared.shape == fresh.shape:
                    setattr(new, weight, shared)
        for holder, name in holders.get(id(module), [(owner, attr)]):
            holder._modules[name] = new

    for name, style in resolved.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module: Any = getattr(parent, child)
        if not include(module) or style is TensorParallelStyle.REPLICATED_SUM:
            continue  # a replicated_sum module stays as it is; the runtime sums its gradients
        if style in (TensorParallelStyle.SEQUENCE_SCATTER, TensorParallelStyle.SEQUENCE_GATHER):
            columns = any(n.startswith(f"{name}.") and other.is_column for n, other in resolved.items())
            _sequence_hooks(module, style, group, has_columns=columns)
            replaced.append(name)
            continue
        if style is TensorParallelStyle.SEQUENCE and not isinstance(module, nn.Dropout):
            continue  # kept whole (a norm); the runtime sums its gradients over the tensor group
        sequence = "none"
        if sequence_parallel:
            # Inside a gathered module every rank holds the whole sequence, which its column
            # layers multiply without ``f`` (the module's gather reduce-scatters in backward).
            inside = any(name.startswith(f"{g}.") for g in gathering)
            sequence = "gathered" if inside else "shard"
        build = _builder(style, group, name, stream, sequence)
        base = lora_base(module)
        if base is None:
            replace(module, build, parent, child)
        else:  # a PEFT LoRA layer: its base layer sliced as planned, its adapters with it
            replace(base, build, module, "base_layer")
            _slice_adapters(module, style, group, name, stream, replace)
        replaced.append(name)
    # A module the plan names but ``include`` left alone on this rank may hold a parameter that a
    # replaced module held too (an output head tied to the embedding, on the embedding's stage):
    # it now holds the shard as well, so that its state-dict key (an alias the stage saves and
    # loads) is this rank's current slice, not a stale whole copy.
    # (A meta shard gets the same treatment once it has values: see ``materialize``.)
    # A shard is never taken for an old parameter: a replaced module's old parameter is freed
    # once the module is, and a shard allocated later at its address has its id.
    new_shards = {id(shard) for shard in shards.values()}
    for sub in model.modules():
        for attr, param in list(sub._parameters.items()):
            stale = param is not None and id(param) in shards and id(param) not in new_shards
            if stale and param is not None and not param.is_meta:
                sub._parameters[attr] = shards[id(param)]
    return replaced


def _slice_adapters(
    module: nn.Module,
    style: TensorParallelStyle,
    group: dist.ProcessGroup,
    name: str,
    stream: RegionStream,
    replace: Callable[[nn.Module, Callable[[nn.Module], nn.Module], nn.Module, str], None],
) -> None:
    """Slice each LoRA adapter of ``module`` consistently with its base layer's ``style`` (see
    :mod:`~lightning_pipe.tensor_parallel.adapters`): a column base's ``lora_B`` by its output
    features, a row base's ``lora_A`` by its input features (its partial outputs summed over the
    tensor ranks before ``lora_B``)."""
    for adapter, lora_a, lora_b, dropouts in adapter_parts(module):
        where = f"{name}.lora_{{}}.{adapter}"
        if style.is_column:
            gather = style is TensorParallelStyle.COLWISE_GATHER

            def column(m: Any, label: str = where.format("B"), gather: bool = gather) -> nn.Module:
                return ColumnParallelLinear(m, group, gather_output=gather, name=label)

            replace(lora_b[adapter], column, lora_b, adapter)
            continue
        parallel = style is TensorParallelStyle.ROWWISE

        def row(m: Any, label: str = where.format("A"), parallel: bool = parallel) -> nn.Module:
            return RowParallelLinear(m, group, input_is_parallel=parallel, name=label)

        replace(lora_a[adapter], row, lora_a, adapter)
        dropout = dropouts[adapter]
        if parallel and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            # It sees this rank's slice of the features: different data on each tensor rank.
            dropouts[adapter] = RegionDropout(dropout.p, stream).train(dropout.training)
