"""Apply a resolved tensor-parallel plan: replace each planned module of this rank by its shard.

What :func:`~.plan.resolve_plan` checked on the whole model is applied here, per rank, to the
modules that rank holds (``include``): each style's replacement (:mod:`.styles`), the sequence
split and gather hooks under sequence parallelism, a PEFT LoRA layer's adapters sliced with their
base layer, and weights shared by several modules (a tied embedding and head) kept shared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.tensor_parallel.adapters import adapter_parts, lora_base
from lightning_pipe.tensor_parallel.cross_entropy import tag_vocab_parallel
from lightning_pipe.tensor_parallel.dropout import RegionDropout, RegionStream, SequenceDropout
from lightning_pipe.tensor_parallel.eager import eager_under_compile
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
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle


@eager_under_compile("forward")
class _LogitsHead(ColumnParallelLinear):
    """A column-parallel output head whose vocab-sharded logits are tagged for the parallel loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tag_vocab_parallel(
            super().forward(x), self.group, dist.get_rank(self.group) * self.out_features
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
        module.register_forward_hook(_ScatterHook(group))
    else:
        module.register_forward_pre_hook(_GatherHook(group, has_columns), with_kwargs=True)


class _SequenceHook:
    """A sequence-parallel hook: what it holds (the group) is shared by copies, as a function's
    closure was (a process group cannot be copied; a copied module keeps its hooks working)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> _SequenceHook:
        return self


@eager_under_compile("__call__")
class _ScatterHook(_SequenceHook):
    """A ``sequence_scatter`` module's forward hook: its output split along the sequence."""

    def __call__(self, _: nn.Module, args: Any, output: Any) -> Any:
        if not sequence_active():
            return output
        if isinstance(output, tuple):
            return (scatter_to_sequence(output[0], self.group), *output[1:])
        return scatter_to_sequence(output, self.group)


@eager_under_compile("__call__")
class _GatherHook(_SequenceHook):
    """A ``sequence_gather`` module's forward pre-hook: its first input gathered along the sequence."""

    def __init__(self, group: dist.ProcessGroup, has_columns: bool) -> None:
        super().__init__(group)
        self.has_columns = has_columns

    def gathered(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_columns:
            return gather_for_module(x, self.group)
        return gather_from_sequence(x, self.group, GatheredGradient.EQUAL)

    def __call__(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not sequence_active():
            return None
        if args:
            return (self.gathered(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self.gathered(kwargs["hidden_states"])}
        raise TypeError(
            "A 'sequence_gather' module was called without a positional input or hidden_states=; "
            "it gathers its first input along the sequence."
        )


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
    it is reached (see :func:`~.plan.resolve_plan`); every attribute that holds it gets the
    replacement.

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
