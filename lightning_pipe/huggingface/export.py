"""Weights back out: a checkpoint as a Hugging Face model directory.

``pipe_tp`` saves a Hugging Face model's tensors under the model's own names (behind the
LightningModule's attribute, ``model.``), and, when it derived the pipeline from the model, the
model's config and that prefix (``checkpoint["huggingface"]``). :func:`export_huggingface` turns a
checkpoint of any layout (a sharded directory, or one file) into what
``AutoModelForCausalLM.from_pretrained`` reads: ``config.json``, safetensors shards with their
index (transformers' own ``save_pretrained``, which also drops the copies of tied weights), and the
tokenizer files of the directory the model came from, when there was one. A model trained with
PEFT adapters (recorded at save) is exported as its adapter directory, or merged on request (see
:mod:`~lightning_pipe.huggingface.adapters`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.metadata import CheckpointError, is_checkpoint_directory

METADATA_KEY = "huggingface"
"""Where a checkpoint keeps the derived model's config, prefix and source directory."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


def model_metadata(model: Any, prefix: str, peft: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint records to be exported later (JSON-like: safe to load); ``peft``: the
    PEFT model's prefix and adapter configs, when PEFT wraps the model (``peft_metadata``)."""
    config = model.config
    source = getattr(config, "_name_or_path", "") or ""
    recorded = {
        "config": config.to_dict(),
        "prefix": prefix,
        "architecture": type(model).__name__,
        "source": str(source),
    }
    if peft is not None:
        recorded["peft"] = peft
    return recorded


def _read(checkpoint: str | Path, trust_pickle: bool) -> dict[str, Any]:
    from lightning_pipe.checkpoint.single_file import consolidate_checkpoint

    path = Path(checkpoint)
    if is_checkpoint_directory(path):
        return consolidate_checkpoint(path, weights_only=True, trust_pickle=trust_pickle)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    raise CheckpointError(f"{path} is neither a pipe_tp checkpoint directory nor a checkpoint file.")


def export_huggingface(
    checkpoint: str | Path,
    output: str | Path,
    *,
    config: str | Path | None = None,
    prefix: str | None = None,
    tokenizer: str | Path | None = None,
    max_shard_size: str = "5GB",
    trust_pickle: bool = False,
    merge: bool = False,
) -> Path:
    """Write ``checkpoint``'s Hugging Face model to the directory ``output``; returns it.

    Args:
        checkpoint: a ``pipe_tp`` checkpoint (directory, or single file), or any Lightning
            checkpoint of a module holding the model.
        config: a directory with the model's ``config.json``, for a checkpoint that does not record
            one (saved without ``pipe_tp`` deriving the pipeline).
        prefix: the model's keys' prefix in the checkpoint (default: the recorded one, else
            ``"model."``).
        tokenizer: a directory to copy tokenizer files from (default: the model's source
            directory, when the checkpoint records one that exists).
        merge: for a model trained with PEFT adapters: write the merged model
            (``AutoModelForCausalLM.from_pretrained`` loads it) instead of the adapter directory
            (``adapter_config.json`` and ``adapter_model.safetensors``, which
            ``PeftModel.from_pretrained`` loads on the base model).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    state = _read(checkpoint, trust_pickle)
    recorded = state.get(METADATA_KEY) or {}
    if config is not None:
        made = AutoConfig.from_pretrained(str(config))
    elif recorded.get("config"):
        values = dict(recorded["config"])
        made = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise CheckpointError(
            f"{checkpoint} records no Hugging Face config (it was not saved by pipe_tp from a derived "
            "Hugging Face model); give the directory of the model's config.json (--config DIR)."
        )
    # Trained without a key/value cache (CausalLMModule turns it off); generation wants it back.
    made.use_cache = True
    out = Path(output)
    if recorded.get("peft") and prefix is None:
        from lightning_pipe.huggingface.adapters import export_peft

        out.mkdir(parents=True, exist_ok=True)
        export_peft(
            state["state_dict"], recorded["peft"], made, out,
            merge=merge, max_shard_size=max_shard_size, source=str(checkpoint),
        )  # fmt: skip
        _copy_tokenizer(tokenizer, recorded, out)
        return out
    if merge:
        raise CheckpointError(
            f"{checkpoint} records no PEFT adapters to merge (merge=True / --merge applies to a model "
            "trained with peft's get_peft_model); export it without."
        )
    prefix = prefix if prefix is not None else recorded.get("prefix", "model.")
    weights = {k[len(prefix) :]: v for k, v in state["state_dict"].items() if k.startswith(prefix)}
    if not weights:
        raise CheckpointError(
            f"{checkpoint} holds no tensor under the prefix {prefix!r}; its keys start like "
            f"{sorted(state['state_dict'])[:3]}. Give the model's prefix (--prefix)."
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(made)
    expected = set(model.state_dict())
    missing = sorted(k for k in expected - set(weights) if not _tied_copy(model, k))
    if missing:
        raise CheckpointError(
            f"{checkpoint} lacks {len(missing)} tensors of {type(model).__name__} under the prefix "
            f"{prefix!r}, e.g. {missing[:3]}."
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=weights, max_shard_size=max_shard_size)
    _copy_tokenizer(tokenizer, recorded, out)
    return out


def _copy_tokenizer(tokenizer: str | Path | None, recorded: dict[str, Any], out: Path) -> None:
    source = Path(tokenizer) if tokenizer is not None else Path(recorded.get("source") or "")
    if str(source) and source.is_dir() and source.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (out / name).exists():
                shutil.copy2(source / name, out / name)


def _tied_copy(model: Any, key: str) -> bool:
    """A key whose tensor is another key's in this model (``lm_head.weight`` tied to the embedding
    when the config ties them): the instance's ties, not the class's list of possible ones."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:  # older transformers: the class's list, valid only when the config ties
        tied = getattr(model, "_tied_weights_keys", None) or {}
        if not getattr(model.config, "tie_word_embeddings", False):
            return False
    return key in tied
