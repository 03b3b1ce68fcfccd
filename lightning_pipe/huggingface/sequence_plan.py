"""The sequence-parallel entries of a Hugging Face causal LM's derived tensor-parallel plan.

Under ``sequence_parallel=True`` the plan also says where the residual stream is split along the
sequence and which modules see all of it. No Hugging Face plan names these points, so they are
derived from the model's structure; that is a concept of its own, apart from the translation of the
model's plan (:mod:`.tensor_parallel`, whose :func:`~.tensor_parallel.derive_plan` calls
:func:`sequence_entries` last).

Each decoder layer's children that hold the plan's column/row layers (``self_attn``, ``mlp``)
gather the sequence at their input (``sequence_gather``: attention reads the sequence length from
its input), its norms and ``nn.Dropout`` children stay whole on this rank's part (``sequence``:
their gradients summed over the tensor ranks), as do the modules between the embedding and the
first layer and after the last one (the final norm); the embedding's output is split
(``sequence_scatter`` on a whole embedding; after a vocab-parallel one, the pipeline's embedding
call splits it), and a whole ``lm_head`` gathers it back (a column-parallel head gathers by
itself). A child whose computation on a part of the sequence could differ from the whole
sequence's (a convolution or state-space mixer, an attention or mixture of experts kept whole) is
refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError
from lightning_pipe.tensor_parallel.plan import pattern_regex
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle, known_style

_COLUMN = frozenset({TensorParallelStyle.COLWISE, TensorParallelStyle.COLWISE_GATHER})
_ROW = frozenset({TensorParallelStyle.ROWWISE, TensorParallelStyle.ROWWISE_SPLIT})


@dataclass(frozen=True)
class SequenceEntries:
    """What sequence parallelism adds to a derived plan."""

    plan: dict[str, str]
    """The entries, keyed by names inside the module trained, in the order they were found."""
    scatter_after_embedding: bool
    """See :attr:`DerivedPlan.scatter_after_embedding
    <lightning_pipe.huggingface.tensor_parallel.DerivedPlan.scatter_after_embedding>`."""
    note: str
    """Where the sequence is split, gathered and kept whole, for the layout log."""


def sequence_entries(
    parts: CausalLMParts,
    prefix: str,
    plan: Mapping[str, str],
    where: str,
    dropped_parents: Mapping[str, list[str]],
) -> SequenceEntries:
    """The sequence-parallel entries to add to the derived ``plan`` (see the module docstring).

    Every child of every decoder layer is classified: one holding tensor-parallel entries gathers
    the sequence (it must hold a row-parallel layer, which reduce-scatters its output back to this
    rank's part, as the residual stream beside it holds); an ``nn.Dropout`` or a per-token norm
    (every weight of shape ``[hidden_size]``) stays whole on this rank's part; a child without
    parameters is left alone; anything else with parameters is refused, since on a part of the
    sequence it may compute otherwise than on the whole (a convolution or state-space mixer, an
    attention whose projections the plan leaves whole). ``sequence_parallel`` entries of the
    model's own plan are accepted as the user's word that their module computes each token alone,
    unless they name a module holding tensor-parallel entries or one inside a gathered module
    (where every rank sees the whole sequence and the gradients are already whole)."""
    model = parts.model
    hidden_size = getattr(parts.config, "hidden_size", None)
    entries = [(pattern_regex(key[len(prefix) :]), key, known_style(value)) for key, value in plan.items()]
    names = [n for n, _ in model.named_modules() if n]

    def entry_of(name: str, sequence: bool) -> tuple[str, TensorParallelStyle] | None:
        """The plan entry naming ``name``: a ``sequence`` one, or (not ``sequence``) another."""
        return next(
            (
                (key, style)
                for regex, key, style in entries
                if style is not None
                and (style is TensorParallelStyle.SEQUENCE) == sequence
                and regex.fullmatch(name)
            ),
            None,
        )

    split = {n: e[1] for n in names if (e := entry_of(n, False)) is not None}
    given = {n: e[0] for n in names if (e := entry_of(n, True)) is not None}

    def dropped_styles(full: str) -> list[str]:
        """The unsupported styles for which the plan's entries at or below ``full`` were dropped."""
        inside = [n for n in names if n == full or n.startswith(f"{full}.")]
        return sorted(
            {
                style
                for parent, styles in dropped_parents.items()
                if parent and any(pattern_regex(parent).fullmatch(n) for n in inside)
                for style in styles
            }
        )

    def classify(full: str, child: nn.Module) -> TensorParallelStyle | None:
        if full in given:
            return None  # the model's plan names it already
        if full in split:
            raise UnsupportedModelError(
                f"{where}: the tensor-parallel plan splits {full} ({type(child).__name__}, "
                f"{split[full].value!r}), a direct child of a decoder layer: under sequence parallelism "
                "pipe_tp gathers the sequence at the input of the module holding the split layers and cannot "
                "do so for a layer on its own. Use sequence_parallel=False for this model."
            )
        inner = {n: style for n, style in split.items() if n.startswith(f"{full}.")}
        if inner:
            if not any(style in _ROW for style in inner.values()):
                raise UnsupportedModelError(
                    f"{where}: {full} ({type(child).__name__}) holds the tensor-parallel entries "
                    f"{sorted(inner)[:3]} but no row-parallel layer: under sequence parallelism it computes "
                    "on the whole sequence, gathered at its input, and its output would stay whole while the "
                    "residual stream beside it holds this rank's part. Use sequence_parallel=False for this "
                    "model."
                )
            return TensorParallelStyle.SEQUENCE_GATHER
        params = list(child.parameters())
        if not params:
            if type(child) is nn.Dropout:
                return TensorParallelStyle.SEQUENCE
            if isinstance(child, nn.modules.dropout._DropoutNd) and child.p > 0:
                raise UnsupportedModelError(
                    f"{where}: {full} is a {type(child).__name__} with p={child.p}; under sequence "
                    "parallelism only nn.Dropout draws its part of the whole sequence's mask. Use "
                    "sequence_parallel=False for this model, or set its probability to 0."
                )
            return None
        if hidden_size is not None and all(p.dim() == 1 and p.shape[0] == hidden_size for p in params):
            return TensorParallelStyle.SEQUENCE  # a per-token norm: its gradients summed over the ranks
        styles = dropped_styles(full)
        pattern = re.sub(r"\.\d+\.", ".*.", full)
        why = (
            f"the tensor-parallel plan leaves it whole (its entries use the styles {styles}, which pipe_tp "
            "does not split), so it would compute on this rank's part of the sequence only, which differs "
            "from the whole sequence wherever tokens meet (an attention would attend within that part)"
            if styles
            else "it is neither a module the tensor-parallel plan splits (those gather the whole sequence) "
            "nor a per-token norm (weights of shape [hidden_size]), so on this rank's part of the sequence "
            "it may compute otherwise than on the whole (a convolution or state-space mixer mixes tokens)"
        )
        raise UnsupportedModelError(
            f"{where}: under sequence_parallel=True, {full} ({type(child).__name__}) holds parameters and "
            f"{why}. Use sequence_parallel=False for this model (tensor parallelism keeps working); if the "
            "module computes each token on its own, name it with the style 'sequence_parallel' in the "
            f"model's tensor-parallel plan (model.tp_plan = {{**model.tp_plan, {pattern!r}: "
            "'sequence_parallel'}})."
        )

    base, layers_name = parts.base_name, parts.layers_name
    layers = list(getattr(parts.base, layers_name))
    found: dict[str, dict[int, TensorParallelStyle | None]] = {}
    gathered_names: list[str] = []
    for index, layer in enumerate(layers):
        own = [n for n, _ in layer.named_parameters(recurse=False)]
        if own:
            raise UnsupportedModelError(
                f"{where}: decoder layer {index} holds parameters of its own ({own}), outside its modules; "
                "pipe_tp cannot tell how they see a part of the sequence. Use sequence_parallel=False for "
                "this model."
            )
        for child_name, child in layer.named_children():
            full = f"{base}.{layers_name}.{index}.{child_name}"
            style = classify(full, child)
            found.setdefault(child_name, {})[index] = style
            if style is TensorParallelStyle.SEQUENCE_GATHER:
                gathered_names.append(full)
    added: dict[str, TensorParallelStyle] = {}
    for child_name, by_index in found.items():
        if len(set(by_index.values())) == 1:  # the same in every layer that has it: one pattern
            style = next(iter(by_index.values()))
            if style is not None:
                added[f"{base}.{layers_name}.*.{child_name}"] = style
            continue
        for index, style in by_index.items():
            if style is not None:
                added[f"{base}.{layers_name}.{index}.{child_name}"] = style
    embed = f"{base}.{parts.before[0]}"
    gathered = [k for k, style in added.items() if style is TensorParallelStyle.SEQUENCE_GATHER]
    embed_style = split.get(embed)
    scatter_after_embedding = False
    if embed_style is TensorParallelStyle.VOCAB:
        scatter_after_embedding = True  # split by the pipeline's embedding call
    elif embed_style is None and embed not in given:
        added[embed] = TensorParallelStyle.SEQUENCE_SCATTER
    else:
        raise UnsupportedModelError(
            f"{where}: the tensor-parallel plan gives the embedding {embed} the style "
            f"{(embed_style.value if embed_style else 'sequence_parallel')!r}; under sequence parallelism "
            "the sequence is split after it, so it takes 'embedding_rowwise' or no entry."
        )
    for name in (*parts.before[1:], *parts.after):
        full = f"{base}.{name}"
        style = classify(full, model.get_submodule(full))
        if style is not None:
            added[full] = style
    head = parts.head_name
    head_style = split.get(head)
    if head in given or (
        head_style is not None and head_style not in (*_COLUMN, TensorParallelStyle.COLWISE_LOGITS)
    ):
        raise UnsupportedModelError(
            f"{where}: the tensor-parallel plan gives {head} the style "
            f"{(head_style.value if head_style else 'sequence_parallel')!r}; under sequence parallelism the "
            "head gathers the sequence, so it takes a column style ('colwise_gather_output') or no entry."
        )
    if head_style is None:
        added[head] = TensorParallelStyle.SEQUENCE_GATHER  # a whole head: the loss sees every token
    for name, key in given.items():
        inside = next((g for g in gathered_names if name.startswith(f"{g}.")), None)
        inner = [n for n in split if n.startswith(f"{name}.")]
        problem = None
        if inside is not None:
            problem = (
                f"is inside {inside}, which gathers the whole sequence: every rank sees all of it there and "
                "its gradients are already whole (summing them would multiply them by the tensor size). "
                "Remove the entry"
            )
        elif inner or name in split:
            held = f"holds the tensor-parallel entries {inner[:3]}" if inner else "is split by the plan too"
            problem = (
                f"{held}: under sequence parallelism such a module gathers the sequence (pipe_tp derives "
                "that) and is not kept whole on this rank's part. Give 'sequence_parallel' to the norms and "
                "dropouts themselves, or remove the entry"
            )
        if problem is not None:
            raise UnsupportedModelError(
                f"{where}: the tensor-parallel plan entry {key!r} ('sequence_parallel') names {name}, which "
                f"{problem}."
            )
    where_split = f"after {prefix}{embed}" + (
        " (by the pipeline's embedding call)" if scatter_after_embedding else ""
    )
    note = (
        f"sequence parallel: the sequence is split {where_split}; gathered at the input of "
        f"{[f'{prefix}{k}' for k in gathered] + ([f'{prefix}{head}'] if head_style is None else [])}; kept "
        "whole on each tensor rank's part (a norm's gradients summed over the tensor ranks, a dropout "
        f"drawing its part of the whole sequence's mask): "
        f"{[f'{prefix}{k}' for k, s in added.items() if s is TensorParallelStyle.SEQUENCE]}"
    )
    return SequenceEntries(
        {f"{prefix}{key}": style.value for key, style in added.items()}, scatter_after_embedding, note
    )
