"""A model trained with PEFT adapters, recorded at save and exported the way PEFT users expect.

``peft.get_peft_model(model, LoraConfig(...))`` inside the module trained wraps the causal LM: the
pipeline is derived from the causal LM inside (``model.base_model.model``), and the checkpoint
holds the wrapped model's tensors under the PEFT model's names (``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``). At save, :func:`peft_metadata` records the PEFT model's
prefix and each adapter's config (JSON-like values); at export, :func:`export_peft` rebuilds the
one-device PEFT model from the recorded configs with peft's own API, loads the consolidated
tensors into it, and writes either the adapter directory (``save_pretrained``:
``adapter_config.json`` and ``adapter_model.safetensors``, which ``PeftModel.from_pretrained``
loads on the base model) or the merged model (``merge_and_unload``, then transformers'
``save_pretrained``: what ``AutoModelForCausalLM.from_pretrained`` loads).
"""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.metadata import CheckpointError


def find_peft_model(root: nn.Module, causal_lm_name: str) -> tuple[str, Any] | None:
    """The PEFT model wrapping the causal LM named ``causal_lm_name`` inside ``root``, with its name
    (``"model"``); ``None`` when peft is not loaded or does not wrap it."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel

    parts = causal_lm_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        sub = root.get_submodule(name)
        if isinstance(sub, PeftModel):
            return name, sub
    return None


def check_peft_materialised(root: nn.Module, causal_lm_name: str) -> None:
    """Refuse a PEFT model built on the meta device: each rank would initialise the adapters with
    the model's own initialiser, not peft's (``lora_B`` zero: the adapted model starting as the
    base), and the pretrained files name the base layers without PEFT's ``base_layer``. (A model
    built with its weights, then wrapped, is what one device trains.)"""
    found = find_peft_model(root, causal_lm_name)
    if found is None:
        return
    name, peft_model = found
    if any(p.is_meta for p in peft_model.parameters()):
        raise ValueError(
            f"{name!r} is a PEFT model built on the meta device (in configure_model() or under "
            "trainer.init_module(empty_init=True)), whose adapters pipe_tp cannot initialise as peft does "
            "nor load from the base model's files. Build the base model with its weights in __init__ "
            "(AutoModelForCausalLM.from_pretrained(DIR)) and wrap it there with get_peft_model, without "
            "pretrained=."
        )


def _plain(value: Any) -> Any:
    """A config value as JSON holds it (sets as sorted lists, enums as their values)."""
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON-like")


def peft_metadata(name: str, peft_model: Any) -> dict[str, Any]:
    """What a checkpoint records to export the adapters later: the PEFT model's key prefix and
    each adapter's config (JSON-like: safe to load)."""
    configs = {
        adapter: json.loads(json.dumps(config.to_dict(), default=_plain))
        for adapter, config in peft_model.peft_config.items()
    }
    return {"prefix": f"{name}.", "adapters": configs}


def _tied(model: Any, key: str) -> bool:
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return key in tied


def export_peft(
    state_dict: dict[str, Any],
    recorded: dict[str, Any],
    config: Any,
    out: Path,
    *,
    merge: bool,
    max_shard_size: str,
    source: str,
) -> None:
    """Write the adapters (or, with ``merge``, the merged model) of the PEFT model whose tensors
    ``state_dict`` holds under ``recorded["prefix"]`` to the directory ``out``."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as err:
        raise CheckpointError(
            f"{source} holds a model trained with PEFT adapters; exporting it needs peft: "
            "pip install 'lightning-pipe[peft]' (or 'peft')."
        ) from err
    from transformers import AutoModelForCausalLM

    prefix = recorded["prefix"]
    weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    floating = [v.dtype for v in weights.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    base = AutoModelForCausalLM.from_config(config, dtype=floating[0] if floating else None)
    configs = {
        name: PeftConfig.from_peft_type(**dict(values)) for name, values in recorded["adapters"].items()
    }
    first, *others = configs
    model = get_peft_model(base, configs[first], adapter_name=first)
    for name in others:
        model.add_adapter(name, configs[name])
    missing, unexpected = model.load_state_dict(weights, strict=False)
    inner = "base_model.model."
    missing = [k for k in missing if not (k.startswith(inner) and _tied(base, k[len(inner) :]))]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not hold the PEFT model it records under the prefix {prefix!r}: "
            f"{len(missing)} tensors missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. "
            f"{unexpected[:3]})."
        )
    if merge:
        merged = model.merge_and_unload()
        merged.config.use_cache = True  # trained without a key/value cache; generation wants it
        merged.save_pretrained(out, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(out)  # the first adapter in out/, any other in out/<its name>/
