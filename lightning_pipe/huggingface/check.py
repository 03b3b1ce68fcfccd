"""Check, once at setup, that the derived pipeline computes what the model's own ``forward`` does.

The pipeline rebuilds on each stage what ``forward`` computes once (masks, rotary tables, the
embedding's prologue) and repeats the head's epilogue; a family that does something else there
would train silently differently. So on the first batch every rank runs the model's own base
``forward`` on the first micro-batch with its modules replaced by stubs that record what each
decoder layer receives (the embedding's stub returns a fixed tensor, each layer's returns its
input): no layer computes, so no rank needs the weights of stages it does not hold, only the
rotary buffers every rank has. The derived calls run over the same stubs, and every layer's
hidden input and keyword arguments (mask, position ids, rotary table, anything else that is not
``None``) must be equal. The rank that holds ``lm_head`` also compares the causal LM's logits on a
fixed hidden state (the base model stubbed) with the head's call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pipe.execution.layers import evaluating
from lightning_pipe.huggingface.context import mask_or_none
from lightning_pipe.tensor_parallel.regions import sequence_parallel_suspended

if TYPE_CHECKING:
    from lightning_pipe.huggingface.parts import CausalLMParts
    from lightning_pipe.huggingface.view import PipelineView

_IGNORED = {"use_cache", "past_key_values", "layer_past", "cache_position", "output_attentions"}
"""Keyword arguments that only concern generation (a cache) or outputs nobody trains with."""

Recorded = list[tuple[torch.Tensor, dict[str, Any]]]


@contextlib.contextmanager
def _stubbed(modules: Sequence[nn.Module], replies: Sequence[Any], record: Recorded | None) -> Iterator[None]:
    """Each module returns its reply (a tensor, or ``None``: its first argument) and records
    its first argument and keyword arguments in ``record``."""

    def stub(reply: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if record is not None:
                record.append((args[0], dict(kwargs)))
            return args[0] if reply is None else reply

        return forward

    # A forward patched onto an instance (e.g. by accelerate's hooks) is put back, not deleted.
    patched = [module.__dict__.get("forward") for module in modules]
    for module, reply in zip(modules, replies, strict=True):
        module.forward = stub(reply)
    try:
        yield
    finally:
        for module, before in zip(modules, patched, strict=True):
            if before is None:
                del module.forward
            else:
                module.forward = before


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    dense = getattr(a, "to_dense", None)
    if callable(dense) and type(a) is type(b):  # a flex-attention BlockMask
        return _same(dense(), b.to_dense())
    return bool(a == b)


def _meaningful(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _IGNORED and v is not None}


def random_hidden(parts: CausalLMParts, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A hidden state for the probe ``input_ids`` (``[b, s, hidden_size]``), the same on every rank
    (drawn from its own seeded generator on the host, then moved): what the checks feed the
    layers instead of the embedding's output, which only the first stage can compute."""
    b, s = input_ids.shape[0], input_ids.shape[1]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, s, parts.config.hidden_size, generator=generator)
    return hidden.to(dtype=dtype, device=input_ids.device)


def check_pipeline(
    pipeline: PipelineView, probe: Any, own_layers: Sequence[nn.Module] = ()
) -> tuple[str | None, str | None]:
    """``(error, None)``: the derived pipeline differs from the model (the error says where);
    ``(None, None)``: it does not (see the module docstring).

    It runs on whole probes, so sequence parallelism is suspended here (the runtime suspends it
    around every forward check too): the embedding call's split, the ``sequence_scatter`` and
    ``sequence_gather`` hooks and the column layers' gathers must not fire on the stubs."""
    with sequence_parallel_suspended():
        return _check_pipeline(pipeline, probe, own_layers)


def _check_pipeline(
    pipeline: PipelineView, probe: Any, own_layers: Sequence[nn.Module]
) -> tuple[str | None, str | None]:
    parts, model = pipeline.parts, pipeline.model
    base = parts.base
    input_ids, mask, positions = probe
    embed = base.get_submodule(parts.before[0])
    layers = list(getattr(base, parts.layers_name))
    after = [base.get_submodule(n) for n in parts.after]
    weight = getattr(embed, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.get_default_dtype()
    hidden = random_hidden(parts, input_ids, dtype)
    where = f"{parts.family} ({type(model).__name__})"
    with evaluating(model), torch.no_grad():
        theirs: Recorded = []
        with _stubbed([embed, *layers, *after], [hidden] + [None] * (len(layers) + len(after)), theirs):
            base(
                input_ids=input_ids,
                attention_mask=mask_or_none(mask),
                position_ids=positions,
                use_cache=False,
            )
        ours: Recorded = []
        pipeline.context.forget()
        before = [base.get_submodule(n) for n in parts.before]  # the embedding, then e.g. a dropout
        with _stubbed([embed, *layers], [hidden] + [None] * len(layers), ours):
            x: Any = (input_ids, mask, positions)
            calls = pipeline.calls()
            for layer, call in zip([*before, *layers], calls, strict=False):
                x = call(layer, x)
        pipeline.context.forget()
        problem = _compare(theirs[1 : 1 + len(layers)], ours[1:], where)
        if problem is None and len(theirs) > 1 + len(layers) and not _same(theirs[1 + len(layers)][0], x[0]):
            problem = f"{where}: the input of the final norm differs from what the model's forward gives it."
        head = model.get_submodule(parts.head_name)
        error = None
        if problem is None and any(layer is head for layer in own_layers):
            problem, error = _compare_head(pipeline, probe, hidden, head, where)
    if problem is None:
        return error, None
    return (
        f"{problem} pipe_tp derives the pipeline of a Hugging Face model from its plan and rebuilds the "
        "masks and rotary tables on each stage; this family computes them otherwise, so training it this "
        "way would differ silently from one device. Write configure_pipeline() (and pipeline_input()) for "
        "it by hand, or train it without pipe_tp."
    ), None


def _compare(theirs: Recorded, ours: Recorded, where: str) -> str | None:
    if len(theirs) != len(ours):
        return f"{where}: the model's forward called {len(theirs)} decoder layers, the pipeline {len(ours)}."
    for index, ((their_hidden, their_kwargs), (our_hidden, our_kwargs)) in enumerate(
        zip(theirs, ours, strict=True)
    ):
        if not _same(their_hidden, our_hidden):
            return (
                f"{where}: decoder layer {index} receives other hidden states than in the model's forward "
                "(it does something to the embeddings that the pipeline does not)."
            )
        a, b = _meaningful(their_kwargs), _meaningful(our_kwargs)
        if set(a) != set(b):
            extra = sorted(set(a) - set(b))
            missing = sorted(set(b) - set(a))
            differences = [f"only the model gives {extra}"] if extra else []
            differences += [f"only the pipeline gives {missing}"] if missing else []
            return (
                f"{where}: decoder layer {index} receives the keyword arguments {sorted(a)} from the model's "
                f"forward but {sorted(b)} from the pipeline ({'; '.join(differences)})."
            )
        for key in a:
            if not _same(a[key], b[key]):
                return f"{where}: decoder layer {index} receives another {key!r} than in the model's forward."
    return None


def _compare_head(
    pipeline: PipelineView, probe: Any, hidden: torch.Tensor, head: nn.Module, where: str
) -> tuple[str | None, str | None]:
    """``(problem, None)``: the logits differ; ``(None, error)``: the balancing loss does (a whole
    message); ``(None, None)``: neither."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    parts = pipeline.parts
    input_ids, mask, positions = probe
    balancing = pipeline.balancing
    routed = bool(getattr(parts.config, "output_router_logits", False))

    class Reply(BaseModelOutputWithPast):
        """The base model's output: the hidden states; any other field is None, but the router
        logits when the model asks for them."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    reply = Reply(last_hidden_state=hidden)
    router_logits = _router_logits(pipeline, input_ids, hidden.dtype) if routed else None
    reply.router_logits = router_logits
    common = dict(
        input_ids=input_ids, attention_mask=mask_or_none(mask), position_ids=positions, use_cache=False
    )
    with _stubbed([parts.base], [reply], None):
        theirs = parts.model(**common)
        if routed:
            labelled = parts.model(**common, labels=input_ids)
            plain = parts.model(**common, labels=input_ids, output_router_logits=False)
    start = balancing.start(input_ids) if balancing is not None else ()
    ours = pipeline.calls()[-1](head, (hidden, mask, positions, *start))
    if not _same(theirs.logits, ours[0] if balancing is not None else ours):
        return (
            f"{where}: the causal LM's logits differ from lm_head's followed by the epilogue pipe_tp knows "
            "(soft-capping, logit_scale, logits_scaling)."
        ), None
    if routed:
        return None, _compare_balancing(pipeline, router_logits, mask, labelled, plain, where)  # type: ignore[arg-type]
    return None, None


def _router_logits(
    pipeline: PipelineView, input_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Two layers' router logits (``[b * s, E]``) for the probe, the same on every rank."""
    balancing = pipeline.balancing
    experts = balancing.num_experts if balancing is not None else 4  # the model only returns them
    generator = torch.Generator().manual_seed(1)
    rows = input_ids.shape[0] * input_ids.shape[1]
    return tuple(
        torch.randn(rows, experts, generator=generator).to(dtype=dtype, device=input_ids.device)
        for _ in range(2)
    )


def _compare_balancing(
    pipeline: PipelineView,
    router_logits: tuple[torch.Tensor, ...],
    mask: torch.Tensor,
    labelled: Any,
    plain: Any,
    where: str,
) -> str | None:
    """With ``output_router_logits=True``: the causal LM's ``aux_loss`` is the one pipe_tp carries
    along the pipeline (or none when pipe_tp found none), and its loss adds it times the
    coefficient pipe_tp read."""
    balancing = pipeline.balancing
    theirs = getattr(labelled, "aux_loss", None)
    fix = "Set model.config.output_router_logits = False, or train without pipe_tp."
    if balancing is None:
        if theirs is not None or not _same(labelled.loss, plain.loss):
            return (
                f"{where}: with output_router_logits=True the causal LM adds an auxiliary loss that pipe_tp "
                f"does not know (it has no router_aux_loss_coef attribute). {fix}"
            )
        return None
    ours = balancing.of_logits(router_logits, mask_or_none(mask))
    if theirs is None or not torch.allclose(theirs.to(ours.dtype), ours, rtol=1e-5, atol=0.0):
        return (
            f"{where}: its router load-balancing loss differs from Hugging Face's load_balancing_loss_func "
            f"(Switch Transformer's, over all layers' router logits), which pipe_tp carries along the "
            f"pipeline. {fix}"
        )
    expected = plain.loss + balancing.coefficient * theirs
    if not torch.allclose(labelled.loss, expected.to(labelled.loss.dtype), rtol=1e-6, atol=0.0):
        return (
            f"{where}: its loss is not the language model's plus router_aux_loss_coef "
            f"({balancing.coefficient}) times the load-balancing loss, as pipe_tp computes it. {fix}"
        )
    return None
