"""A Hugging Face causal LM's tensor-parallel plan, from the model's own public plan.

``model.tp_plan`` (transformers 5.x; ``config.base_model_tp_plan`` and the causal LM's own entry
before it) maps module-name patterns to styles: ``colwise``/``rowwise`` for the attention and MLP
projections, ``embedding_rowwise`` for the token embedding, ``colwise_gather_output`` for
``lm_head``, ``replicated_with_grad_allreduce`` for per-head query/key norms. ``pipe_tp``
implements these (see :mod:`lightning_pipe.tensor_parallel.styles`). Styles it does not implement
(fused ``packed_*`` projections, mixture-of-experts and MLA styles, Hugging Face's ``local_*``
styles) are dropped *with every entry under the same parent* (a ``rowwise`` down projection
needs its ``packed_colwise`` partner split, so it cannot stay alone): those modules stay whole,
computing the same values on every tensor rank, and a log line says so. Never a silent
difference: a model the split would change (heads not divisible by the tensor size, Cohere's
per-head norms without a plan entry) is refused with the reason.

Under ``sequence_parallel=True`` the plan also says where the residual stream is split along the
sequence and which modules see all of it, derived from the model's structure
(:mod:`.sequence_plan`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError
from lightning_pipe.huggingface.sequence_plan import sequence_entries
from lightning_pipe.tensor_parallel.plan import pattern_regex
from lightning_pipe.tensor_parallel.styles import TensorParallelStyle, known_style


@dataclass
class DerivedPlan:
    """The plan for the module trained, and what was left whole, for the layout log."""

    plan: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    scatter_after_embedding: bool = False
    """Under sequence parallelism with a vocab-parallel embedding: the pipeline's embedding call
    splits the hidden states along the sequence (the plan cannot give the embedding a second
    style), so the plan holds no ``sequence_scatter`` entry."""


def _supported(style: str, sequence_parallel: bool = False) -> bool:
    """A style the derived plan keeps. ``sequence_parallel`` entries (ours: ``sequence``) are kept
    under sequence parallelism, where they mean what they mean in a hand-written plan; without it
    they are dropped (their modules stay whole, as they would anyway). The split points
    (``sequence_scatter``/``sequence_gather``) are derived, never read from the model's plan."""
    parsed = known_style(style)
    if parsed is None:
        return False
    return not parsed.is_sequence or (sequence_parallel and parsed is TensorParallelStyle.SEQUENCE)


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
    sequence-parallel entries of :func:`~.sequence_plan.sequence_entries`."""
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
        parsed = known_style(str(value))
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
        regex = pattern_regex(pattern)
        if not any(regex.fullmatch(n) for n in names):
            derived.notes.append(f"{prefix}{pattern}: matches no module of this model (ignored)")
            continue
        derived.plan[f"{prefix}{pattern}"] = str(style)
    _keep_tied_pairs(parts, prefix, derived)
    _check_heads(parts, derived, tensor_parallel_size, where)
    if tensor_parallel_size > 1:
        _cover_split_siblings(parts, prefix, derived, where)
    if sequence:
        added = sequence_entries(parts, prefix, derived.plan, where, dropped_parents)
        derived.plan.update(added.plan)
        derived.scatter_after_embedding = added.scatter_after_embedding
        derived.notes.append(added.note)
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
    named = [(pattern_regex(k[len(prefix) :]), v) for k, v in derived.plan.items()]
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
