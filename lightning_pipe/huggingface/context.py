"""What a Hugging Face model's ``forward`` computes once for all its layers, rebuilt on each stage.

``LlamaModel.forward`` (and every family's like it) builds the attention mask (causal, sliding
window, or one per layer type), the rotary table and the position ids once, then hands them to
every decoder layer. Under a pipeline no stage runs that ``forward``, and no stage holds the whole
model; so only what those depend on travels with the hidden states (the ``[b, s]`` padding mask
and position ids, a few bytes per token), and each stage rebuilds the rest with the library's own
functions (``create_masks_for_generate``, the model's rotary module, which every rank holds: it
has buffers only). :mod:`lightning_pipe.huggingface.check` verifies once, at setup, that each
layer receives exactly what the model's own ``forward`` would give it.

The padding mask travels as a ``[b, 0]`` tensor when there is none: Hugging Face tells packed
sequences (``position_ids`` restarting at 0) from padding only when ``attention_mask is None``,
so an all-ones mask would not do.

Also here: what some families do outside every module, before the first layer (Granite's
``embedding_multiplier``) and after the head (Gemma's logit soft-capping, Cohere's
``logit_scale``, Granite's ``logits_scaling``).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.huggingface.parts import CausalLMParts

IGNORE_INDEX = -100
"""The label of a token that is not a target (Hugging Face's and PyTorch's convention)."""

Carried = tuple[torch.Tensor, torch.Tensor]
"""What travels beside the hidden states: the padding mask (``[b, s]``, or ``[b, 0]`` for none)
and the position ids (``[b, s]``)."""


@functools.cache
def _cache_argument() -> str:
    """What ``create_masks_for_generate`` calls its cache: ``cache`` since transformers 5.2x,
    ``past_key_values`` before (still accepted there, with a deprecation warning on every call)."""
    from transformers.masking_utils import create_masks_for_generate

    names = inspect.signature(create_masks_for_generate).parameters
    return "cache" if "cache" in names else "past_key_values"


def no_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """The carried stand-in for ``attention_mask=None``."""
    return input_ids.new_zeros((input_ids.shape[0], 0), dtype=torch.bool)


def mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    return None if mask.shape[-1] == 0 else mask


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """``arange(s)`` for every sample: what the model uses when given no position ids."""
    b, s = input_ids.shape[0], input_ids.shape[1]
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s).contiguous()


def whole_sequence(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``hidden`` as the mask builders and rotary modules read it: for the whole sequence.

    Under sequence parallelism a decoder layer receives this rank's part of the sequence
    (``[b, s/t, h]``) while its attention computes on the whole, gathered sequence; transformers'
    mask functions take the query length from ``inputs_embeds.shape[1]`` and would build masks for
    ``s/t`` queries. The positions are always whole (``[b, s]``), so a zero-copy stand-in of the
    whole sequence's shape (one row expanded; only its shape, dtype and device are read) is given
    instead."""
    s = positions.shape[-1]
    if hidden.shape[1] == s:
        return hidden
    # The batch of the hidden states: position ids may be one row for every sample ([1, s]).
    return hidden[:, :1].expand(hidden.shape[0], s, *hidden.shape[2:])


class LayerContext:
    """The keyword arguments of decoder layer ``i``, rebuilt from the hidden states, the padding
    mask and the position ids (see the module docstring)."""

    def __init__(self, parts: CausalLMParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.layer_types: list[str] | None = getattr(self.config, "layer_types", None)
        base = parts.base
        self._rotary_name = "rotary_emb" if hasattr(base, "rotary_emb") else None
        rotary = self.rotary
        self._rotary_by_type = (
            rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        )
        # One entry each: the stage's layers of one micro-batch share the same mask and table (the
        # key holds the carried tensors themselves, so their ids cannot be reused meanwhile).
        self._masks: tuple[tuple[Any, ...], Any] | None = None
        self._tables: dict[str | None, tuple[tuple[Any, ...], Any]] = {}

    @property
    def rotary(self) -> torch.nn.Module | None:
        return getattr(self.parts.base, self._rotary_name) if self._rotary_name else None

    def layer_type(self, index: int) -> str | None:
        return self.layer_types[index] if self.layer_types else None

    def masks(self, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        from transformers.masking_utils import create_masks_for_generate

        hidden = whole_sequence(hidden, positions)
        key = (mask, positions, hidden.shape, hidden.dtype, hidden.device)
        cached = self._masks
        if cached is not None and _same_key(cached[0], key):
            return cached[1]
        value = create_masks_for_generate(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask_or_none(mask),
            position_ids=positions,
            **{_cache_argument(): None},
        )
        self._masks = (key, value)
        return value

    def table(self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str | None) -> Any:
        rotary = self.rotary
        if rotary is None:
            return None
        kind = layer_type if self._rotary_by_type else None
        hidden = whole_sequence(hidden, positions)
        key = (positions, hidden.dtype, hidden.device)
        cached = self._tables.get(kind)
        if cached is not None and _same_key(cached[0], key):
            return cached[1]
        value = rotary(hidden, positions, kind) if self._rotary_by_type else rotary(hidden, positions)
        self._tables[kind] = (key, value)
        return value

    def __call__(
        self, index: int, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, Any]:
        """Decoder layer ``index``'s keyword arguments, as the model's ``forward`` gives them."""
        kind = self.layer_type(index)
        masks = self.masks(hidden, mask, positions)
        if isinstance(masks, dict):
            if kind is None and len(masks) == 1:
                kind = next(iter(masks))
            if kind not in masks:
                raise KeyError(
                    f"{self.parts.family}: decoder layer {index} has layer type {kind!r}, but the masks "
                    f"built for the model's layer types are {sorted(masks)}."
                )
            layer_mask = masks[kind]
        else:
            layer_mask = masks
        kwargs: dict[str, Any] = {"attention_mask": layer_mask, "position_ids": positions}
        table = self.table(hidden, positions, kind)
        if table is not None:
            kwargs["position_embeddings"] = table
        return kwargs

    def forget(self) -> None:
        """Drop the cached mask and tables (and the tensors their keys hold)."""
        self._masks = None
        self._tables.clear()


def _same_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(
        x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a, b, strict=True)
    )


@dataclass(frozen=True)
class Prologue:
    """What the model's ``forward`` does to the embeddings outside every module."""

    multiplier: float | None = None
    """Granite (and HyperCLOVAX): ``inputs_embeds * embedding_multiplier``."""

    @classmethod
    def of(cls, parts: CausalLMParts) -> Prologue:
        value = getattr(parts.base, "embedding_multiplier", None)
        return cls(float(value) if isinstance(value, int | float) and value != 1 else None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.multiplier if self.multiplier is not None else hidden


@dataclass(frozen=True)
class Epilogue:
    """What the causal LM's ``forward`` does to the logits after ``lm_head``."""

    softcap: float | None = None
    """``config.final_logit_softcapping`` (Gemma 2 and 3): ``tanh(logits / c) * c``."""
    logit_scale: float | None = None
    """Cohere: ``logits * logit_scale``."""
    logits_scaling: float | None = None
    """Granite: ``logits / logits_scaling``."""

    @classmethod
    def of(cls, parts: CausalLMParts) -> Epilogue:
        config = parts.config

        def number(value: Any) -> float | None:
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

        return cls(
            number(getattr(config, "final_logit_softcapping", None)),
            number(getattr(parts.model, "logit_scale", None)),
            number(getattr(config, "logits_scaling", None)),
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        return logits
