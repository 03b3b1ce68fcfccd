"""A Hugging Face causal LM's tensor-parallel plan, from the model's own public plan.

``model.tp_plan`` (transformers 5.x; ``config.base_model_tp_plan`` and the causal LM's own entry
before it) maps module-name patterns to styles: ``colwise``/``rowwise`` for the attention and MLP
projections, ``embedding_rowwise`` for the token embedding, ``colwise_gather_output`` for
``lm_head``, ``replicated_with_grad_allreduce`` for per-head query/key norms. ``pipe_tp``
implements these (see :mod:`lightning_pipe.tensor_parallel.plan`). Styles it does not implement
(fused ``packed_*`` projections, mixture-of-experts and MLA styles, Hugging Face's ``local_*``
styles) are dropped *with every entry under the same parent* (a ``rowwise`` down projection
needs its ``packed_colwise`` partner split, so it cannot stay alone): those modules stay whole,
computing the same values on every tensor rank, and a log line says so. Never a silent
difference: a model the split would change (heads not divisible by the tensor size, Cohere's
per-head norms without a plan entry) is refused with the reason.

Under ``sequence_parallel=True`` (:func:`_add_sequence_entries`) the plan also says where the
residual stream is split along the sequence and which modules see all of it, derived from the
model's structure, since no Hugging Face plan names these points: each decoder layer's children
that hold the plan's column/row layers (``self_attn``, ``mlp``) gather the sequence at their input
(``sequence_gather``: attention reads the sequence length from its input), its norms and
``nn.Dropout`` children stay whole on this rank's part (``sequence``: their gradients summed over
the tensor ranks), as do the modules between the embedding and the first layer and after the last
one (the final norm); the embedding's output is split (``sequence_scatter`` on a whole embedding;
after a vocab-parallel one, the pipeline's embedding call splits it), and a whole ``lm_head``
gathers it back (a column-parallel head gathers by itself). A child whose computation on a part of
the sequence could differ from the whole sequence's (a convolution or state-space mixer, an
attention or mixture of experts kept whole) is refused, naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError
from lightning_pipe.tensor_parallel.plan import HF_STYLES, TensorParallelStyle

_OURS = {style.value for style in TensorParallelStyle}
_COLUMN = frozenset({TensorParallelStyle.COLWISE, TensorParallelStyle.COLWISE_GATHER})
_ROW = frozenset({TensorParallelStyle.ROWWISE, TensorParallelStyle.ROWWISE_SPLIT})


@dataclass
class DerivedPlan:
    """The plan for the module trained, and what was left whole, for the layout log."""

    plan: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    scatter_after_embedding: bool = False
    """Under sequence parallelism with a vocab-parallel embedding: the pipeline's embedding call
    splits the hidden states along the sequence (the plan cannot give the embedding a second
    style), so the plan holds no ``sequence_scatter`` entry."""


def _parsed(style: str) -> TensorParallelStyle | None:
    name = style.lower()
    return HF_STYLES.get(name) or (TensorParallelStyle(name) if name in _OURS else None)


def _supported(style: str, sequence_parallel: bool = False) -> bool:
    """A style the derived plan keeps. ``sequence_parallel`` entries (ours: ``sequence``) are kept
    under sequence parallelism, where they mean what they mean in a hand-written plan; without it
    they are dropped (their modules stay whole, as they would anyway). The split points
    (``sequence_scatter``/``sequence_gather``) are derived, never read from the model's plan."""
    parsed = _parsed(style)
    if parsed is None:
        return False
    return not parsed.is_sequence or (sequence_parallel and parsed is TensorParallelStyle.SEQUENCE)


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if p == "*" else re.escape(p) for p in re.split(r"(\*)", pattern)))


def model_plan(model: nn.Module) -> dict[str, str]:
    """The causal LM's merged plan, relative to the causal LM (its public ``tp_plan``, or the
    config's base plan under the base model's name and the class's own entries)."""
    lm: Any = model
    plan = getattr(lm, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base_plan = getattr(lm.config, "base_model_tp_plan", None) or {}
    own = getattr(type(lm), "_tp_plan", None) or {}
    return {**own, **{f"{lm.base_model_prefix}.{k}": v for k, v in base_plan.items()}}


def derive_plan(
    parts: CausalLMParts, prefix: str, tensor_parallel_size: int, sequence_parallel: bool = False
) -> DerivedPlan:
    """The plan ``pipe_tp`` applies, keyed by names inside the module trained (``prefix`` + the
    model's own names); with ``sequence_parallel`` (and more than one tensor rank), with the
    sequence-parallel entries of :func:`_add_sequence_entries`."""
    model = parts.model
    plan = model_plan(model)
    where = f"{parts.family} ({type(model).__name__})"
    if not plan:
        raise UnsupportedModelError(
            f"{where} ships no tensor-parallel plan (config.base_model_tp_plan is empty); give "
            "PipeTPStrategy(tensor_parallel_plan=...) or a tensor_parallel_plan() hook, or use "
            "tensor_parallel_size=1."
        )
    derived = DerivedPlan()
    names = [n for n, _ in model.named_modules() if n]
    parents: dict[str, list[str]] = {}
    for pattern in plan:
        parents.setdefault(pattern.rpartition(".")[0], []).append(pattern)
    sequence = sequence_parallel and tensor_parallel_size > 1
    for pattern, value in plan.items():
        parsed = _parsed(str(value))
        if (
            sequence
            and parsed is not None
            and parsed.is_sequence
            and parsed is not TensorParallelStyle.SEQUENCE
        ):
            raise UnsupportedModelError(
                f"{where}: its tensor-parallel plan gives {pattern!r} the style {value!r}; for a Hugging "
                "Face model pipe_tp derives where the sequence is split and gathered itself. Remove the "
                "entry ('sequence_parallel' entries on norms and dropouts are accepted)."
            )
    dropped: set[str] = set()
    dropped_parents: dict[str, list[str]] = {}
    for parent, patterns in parents.items():
        unsupported = [p for p in patterns if not _supported(str(plan[p]), sequence)]
        if unsupported:
            dropped |= set(patterns)
            styles = sorted({str(plan[p]) for p in unsupported})
            dropped_parents[parent] = styles
            derived.notes.append(
                f"{prefix}{parent or '<model>'}: {sorted(patterns)} kept whole on every tensor rank "
                f"(pipe_tp does not split the styles {styles})"
            )
    for pattern, style in plan.items():
        if pattern in dropped:
            continue
        regex = _regex(pattern)
        if not any(regex.fullmatch(n) for n in names):
            derived.notes.append(f"{prefix}{pattern}: matches no module of this model (ignored)")
            continue
        derived.plan[f"{prefix}{pattern}"] = str(style)
    _keep_tied_pairs(parts, prefix, derived)
    _check_heads(parts, derived, tensor_parallel_size, where)
    if tensor_parallel_size > 1:
        _cover_split_siblings(parts, prefix, derived, where)
    if sequence:
        _add_sequence_entries(parts, prefix, derived, where, dropped_parents)
    return derived


def _cover_split_siblings(parts: CausalLMParts, prefix: str, derived: DerivedPlan, where: str) -> None:
    """Parameters beside a ``colwise`` projection (whose output stays split by heads) that the plan
    does not name. A per-head norm (weight of shape ``[head_dim]``, e.g. GLM-4's q/k norms when its
    plan omits them) computes within each head, so it stays whole and its gradients, partial on
    each tensor rank, are summed (``replicated_sum``), as the plans that name it ask. Anything else
    there could see split features or contribute partial gradients; what it does cannot be told
    from its name, so the model is refused rather than trained differently."""
    model = parts.model
    config = parts.config
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
        if getattr(config, "num_attention_heads", 0)
        else None
    )
    named = [(_regex(k[len(prefix) :]), v) for k, v in derived.plan.items()]
    in_layers = f"{parts.base_name}.{parts.layers_name}."

    def style_of(name: str) -> str | None:
        return next((v for regex, v in named if regex.fullmatch(name)), None)

    added: set[str] = set()
    for name, _ in model.named_modules():
        if not name.startswith(in_layers) or style_of(name) != "colwise":
            continue
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        own = [n for n, _ in parent.named_parameters(recurse=False)]
        if own:
            raise UnsupportedModelError(
                f"{where}: {parent_name} holds parameters of its own ({own}) beside the column-split "
                f"{name}, which its tensor-parallel plan does not name; pipe_tp cannot tell whether they "
                "see split features. Use tensor_parallel_size=1, or give tensor_parallel_plan=... naming "
                "them."
            )
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            params = list(child.parameters())
            if (
                not params
                or style_of(full) is not None
                or any(style_of(n) is not None for n, _ in child.named_modules(prefix=full))
            ):
                continue
            pattern = re.sub(r"\.\d+\.", ".*.", full)
            if "norm" in child_name.lower() and all(tuple(p.shape) == (head_dim,) for p in params):
                if pattern not in added:
                    added.add(pattern)
                    derived.plan[f"{prefix}{pattern}"] = "replicated_with_grad_allreduce"
                    derived.notes.append(
                        f"{prefix}{pattern}: a per-head norm beside a column-split projection, kept whole "
                        "with its gradients summed over the tensor ranks (its plan does not name it)"
                    )
                continue
            raise UnsupportedModelError(
                f"{where}: {full} ({type(child).__name__}) has parameters beside the column-split {name} and "
                "its tensor-parallel plan does not name it; pipe_tp cannot tell whether it sees split "
                "features or contributes partial gradients. Use tensor_parallel_size=1, or give "
                "tensor_parallel_plan=... naming it."
            )


def _keep_tied_pairs(parts: CausalLMParts, prefix: str, derived: DerivedPlan) -> None:
    """An embedding tied to ``lm_head`` is split with it or not at all (a vocab-parallel
    embedding whose class computes more than a lookup is kept whole, and then so is the head)."""
    model = parts.model
    embed_name = f"{parts.base_name}.{parts.before[0]}"
    embed = model.get_submodule(embed_name)
    head = model.get_submodule(parts.head_name)
    tied = getattr(embed, "weight", None) is not None and getattr(head, "weight", None) is embed.weight
    key = f"{prefix}{embed_name}"
    splittable = (
        type(embed).forward is nn.Embedding.forward or getattr(embed, "embed_scale", None) is not None
    )
    if key in derived.plan and not splittable:
        del derived.plan[key]
        derived.notes.append(f"{key}: kept whole ({type(embed).__name__} computes more than a lookup)")
    head_key = f"{prefix}{parts.head_name}"
    if tied and (key in derived.plan) != (head_key in derived.plan):
        for k in (key, head_key):
            derived.plan.pop(k, None)
        derived.notes.append(f"{key} and {head_key}: tied, kept whole together")


def _check_heads(parts: CausalLMParts, derived: DerivedPlan, tp: int, where: str) -> None:
    config = parts.config
    attention = [p for p in derived.plan if re.search(r"attn|attention", p)]
    if not attention or tp == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp != 0:
            raise UnsupportedModelError(
                f"{where}: {what}={count} cannot be split evenly over tensor_parallel_size={tp} ranks (each "
                f"rank needs whole heads). Use a tensor-parallel size that divides {count}."
            )
    if getattr(config, "use_qk_norm", False) and parts.family.startswith("cohere"):
        raise UnsupportedModelError(
            f"{where} with use_qk_norm=True normalises each head with a weight of shape [heads, head_dim] "
            "that its plan does not split, so the attention cannot be split over tensor ranks; use "
            "tensor_parallel_size=1 for it."
        )


def _add_sequence_entries(
    parts: CausalLMParts, prefix: str, derived: DerivedPlan, where: str, dropped_parents: dict[str, list[str]]
) -> None:
    """The sequence-parallel entries of the plan (see the module docstring), added to ``derived``.

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
    entries = [(_regex(key[len(prefix) :]), key, _parsed(value)) for key, value in derived.plan.items()]
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
                if parent and any(_regex(parent).fullmatch(n) for n in inside)
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
    if embed_style is TensorParallelStyle.VOCAB:
        derived.scatter_after_embedding = True  # split by the pipeline's embedding call
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
    for key, style in added.items():
        derived.plan[f"{prefix}{key}"] = style.value
    where_split = f"after {prefix}{embed}" + (
        " (by the pipeline's embedding call)" if derived.scatter_after_embedding else ""
    )
    derived.notes.append(
        f"sequence parallel: the sequence is split {where_split}; gathered at the input of "
        f"{[f'{prefix}{k}' for k in gathered] + ([f'{prefix}{head}'] if head_style is None else [])}; kept "
        "whole on each tensor rank's part (a norm's gradients summed over the tensor ranks, a dropout "
        f"drawing its part of the whole sequence's mask): "
        f"{[f'{prefix}{k}' for k, s in added.items() if s is TensorParallelStyle.SEQUENCE]}"
    )
