"""Where a Hugging Face causal LM keeps what a pipeline needs, read from its own plan.

Since transformers 4.5x a causal-LM family that supports parallelism ships
``config.base_model_pp_plan``: its base model's children in execution order, with the tensors
that flow between them (``embed_tokens: (["input_ids"], ["inputs_embeds"])``, ``layers:
(["hidden_states", "attention_mask"], ["hidden_states"])``, ``norm``), and the causal LM adds
``lm_head``. The modules before the decoder layers, the layers, the modules after them and the
head are the pipeline, in that order (the model's ``pp_plan`` property lists ``lm_head`` first,
so the order is taken from the config's plan). What the plan does not name, the model's
``forward`` computes once for every layer (the causal or sliding-window mask, the rotary table);
:mod:`lightning_pipe.huggingface.context` rebuilds that on each stage.

A model that cannot be followed this way is refused here, naming the family and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

# Families whose decoder layers take state beyond the hidden states, the masks and the positions
# (carried from one layer to the next, or the model's input ids): a pipeline of the plan's modules
# would drop it.
_CARRIED_STATE = {
    "gemma3n_text": "its layers share key/value states across layers (shared_kv_states)",
    "gemma4_text": "its layers share key/value states across layers (shared_kv_states)",
    "gemma4_unified_text": "its layers share key/value states across layers (shared_kv_states)",
    "glm_moe_dsa": "each layer takes the previous layer's top-k indices (prev_topk_indices)",
    "hy_v4": "each layer takes the previous layer's top-k indices (prev_topk_indices)",
    "deepseek_v4": "its layers take the input ids as well as the hidden states",
    "beam": "its layers take an attention scaling computed by the model's forward",
    "inkling_text": "its layers take a convolution mask, and its logits are cut to the unpadded vocabulary",
    "hrm_text": "it has no list of decoder layers (its forward loops over reasoning modules)",
}


class UnsupportedModelError(ValueError):
    """A Hugging Face model whose pipeline ``pipe_tp`` cannot derive; the message says why."""


@dataclass(frozen=True)
class CausalLMParts:
    """A causal LM's pipeline parts, as names relative to the causal LM itself."""

    model: nn.Module
    """The ``...ForCausalLM`` (a ``transformers.PreTrainedModel``)."""
    family: str
    """``config.model_type``: how messages name the model."""
    base_name: str
    """The base model's attribute (``base_model_prefix``: ``"model"``, ``"gpt_neox"``, ...)."""
    before: tuple[str, ...]
    """The base model's children before the decoder layers (``embed_tokens``, a dropout)."""
    layers_name: str
    """The base model's ``nn.ModuleList`` of decoder layers."""
    after: tuple[str, ...]
    """The base model's children after the layers (the final norm)."""
    head_name: str = "lm_head"

    @property
    def base(self) -> nn.Module:
        return getattr(self.model, self.base_name)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(getattr(self.base, self.layers_name))

    def names(self) -> list[str]:
        """The pipeline layers' names inside the causal LM, in order."""
        base = self.base_name
        return (
            [f"{base}.{n}" for n in self.before]
            + [f"{base}.{self.layers_name}.{i}" for i in range(self.num_layers)]
            + [f"{base}.{n}" for n in self.after]
            + [self.head_name]
        )


def is_causal_lm(module: nn.Module) -> bool:
    """Whether ``module`` looks like a Hugging Face causal LM (without importing transformers when
    it is not loaded: a module of another library cannot be one)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return (
        isinstance(module, PreTrainedModel)
        and hasattr(module, "base_model_prefix")
        and head_name(module) is not None
        and isinstance(getattr(module, module.base_model_prefix, None), nn.Module)
    )


def head_name(model: nn.Module) -> str | None:
    """The attribute name of the model's output projection: ``lm_head`` in most families, another
    in some (``embed_out`` in GPT-NeoX before transformers 5.16), found through the model's own
    ``get_output_embeddings()``; ``None`` when it has none among its direct children."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, child in model.named_children() if child is head), None)


MIN_TRANSFORMERS = (5, 5)
"""The oldest transformers whose mask functions and plans this package follows (tested: 5.5.4 and
5.23); older ones take other arguments (``cache_position``) and name some heads otherwise."""


def _check_transformers_version() -> None:
    import transformers

    found = transformers.__version__
    parts = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
    if parts < MIN_TRANSFORMERS:
        wanted = ".".join(map(str, MIN_TRANSFORMERS))
        raise UnsupportedModelError(
            f"pipe_tp derives Hugging Face pipelines with transformers >= {wanted}; this environment has "
            f"{found}. Upgrade it: pip install -U 'lightning-pipe[huggingface]' "
            f"(or 'transformers>={wanted}')."
        )


def causal_lm_parts(model: nn.Module) -> CausalLMParts:
    """Read ``model``'s pipeline from its ``base_model_pp_plan``; refuse what cannot be followed."""
    lm: Any = model  # a PreTrainedModel: its attributes are not typed as modules' are
    name = type(model).__name__
    if not is_causal_lm(model):
        raise UnsupportedModelError(
            f"{name} is not a Hugging Face causal language model (a PreTrainedModel with a base model "
            "and an output projection such as lm_head, such as LlamaForCausalLM)."
        )
    _check_transformers_version()
    config = lm.config
    family = str(getattr(config, "model_type", name))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        raise UnsupportedModelError(
            f"{name} ({family}) is a composite model (its language model sits in a text_config); pipe_tp "
            "pipelines causal language models only: build the text model alone (its *ForCausalLM class "
            "from the text config)."
        )
    if family in _CARRIED_STATE:
        raise UnsupportedModelError(
            f"{name} ({family}) cannot be split into pipeline stages by its plan: {_CARRIED_STATE[family]}. "
            "Write configure_pipeline() for it by hand, or train it without pipe_tp."
        )
    plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    if not plan:
        raise UnsupportedModelError(
            f"{name} ({family}) has no pipeline plan (config.base_model_pp_plan is empty), so pipe_tp cannot "
            "tell its modules' order and what flows between them. Families with a plan include llama, "
            "mistral, qwen2/3, gemma2/3, phi3, cohere2, granite, gpt_neox and mixtral; for this one, write "
            "configure_pipeline() by hand."
        )
    names = list(plan)
    layer_keys = [
        k for k in names if list(plan[k][0])[:1] == ["hidden_states"] and "attention_mask" in plan[k][0]
    ]
    base = getattr(lm, lm.base_model_prefix)
    if len(layer_keys) != 1 or not isinstance(getattr(base, layer_keys[0], None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{name} ({family}): its pipeline plan {names} names no single list of decoder layers taking "
            "(hidden_states, attention_mask); pipe_tp cannot follow it. Write configure_pipeline() by hand."
        )
    k = names.index(layer_keys[0])
    missing = [n for n in names if not isinstance(getattr(base, n, None), nn.Module)]
    if missing:
        raise UnsupportedModelError(
            f"{name} ({family}): its pipeline plan names {missing}, which the base model does not have."
        )
    first_inputs = list(plan[names[0]][0]) if k > 0 else []
    # After the embedding, each module takes the hidden states alone (whatever the plan calls them:
    # "hidden_states", GPT-NeoX's dropout "inputs_embeds").
    others = [n for n in names[1:k] + names[k + 1 :] if len(plan[n][0]) != 1]
    if first_inputs != ["input_ids"] or others:
        odd = others if first_inputs == ["input_ids"] else [names[0], *others]
        raise UnsupportedModelError(
            f"{name} ({family}): its pipeline plan {names} is not an embedding of input_ids, decoder "
            f"layers and modules of the hidden states alone ({odd} take {[list(plan[n][0]) for n in odd]}); "
            "pipe_tp cannot follow it. Write configure_pipeline() by hand."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{name} ({family}) uses bidirectional attention (config.use_bidirectional_attention=True), "
            "whose mask pipe_tp does not rebuild on each stage; set it to False for causal training."
        )
    return CausalLMParts(
        model=model,
        family=family,
        base_name=lm.base_model_prefix,
        before=tuple(names[:k]),
        layers_name=names[k],
        after=tuple(names[k + 1 :]),
        head_name=head_name(model) or "lm_head",
    )
