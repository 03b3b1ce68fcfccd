"""PEFT's LoRA layers under a tensor-parallel plan: the base layer sliced, the adapters with it.

``peft.get_peft_model`` wraps each targeted ``nn.Linear`` in a ``lora.Linear`` that keeps the
original as ``base_layer`` and computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``
per active adapter. A plan entry naming such a wrapper (the plan speaks the model's names, and the
wrapper took the Linear's) applies to its base layer, and each adapter is sliced so that the sum
stays what one device computes:

* column-parallel base (output features split): ``lora_B`` is split along its output features
  with the same slice (a column-parallel layer of its own, whose ``f`` sums the partial gradients
  of ``lora_A``'s output over the tensor ranks); ``lora_A`` stays whole and its gradient, computed
  from that summed gradient and the whole input, is equal on every tensor rank. Its dropout sees
  the replicated input, drawn from the default generator alike on every rank.
* row-parallel base (input features split): ``lora_A`` is split along its input features (a
  row-parallel layer of its own: its partial outputs, ``r`` features, are summed over the tensor
  ranks before ``lora_B``), ``lora_B`` stays whole and sees the summed, whole activations. Under
  ``rowwise`` its dropout sees this rank's slice of the features: a region dropout (its own stream
  per tensor rank, like any dropout inside a tensor-parallel region).

PEFT is recognised by its structure, not imported. Anything whose sum cannot be kept equal is
refused at setup naming the layer: another tuner than LoRA, DoRA and other LoRA variants, an
adapter merged into its base, a LoRA on an embedding or on the vocab-parallel logits, and LoRA
under sequence parallelism.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def lora_base(module: nn.Module) -> nn.Module | None:
    """The layer a PEFT tuner layer wraps (``base_layer``), or ``None`` when ``module`` is not one."""
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and callable(getattr(module, "get_base_layer", None)):
        return base
    return None


def check_lora(name: str, module: nn.Module, style_value: str, supported: bool, sequence: bool) -> None:
    """Refuse a PEFT layer whose adapters cannot be sliced with its base (see the module docstring).

    ``supported``: whether the style is a column or row split of a Linear; ``sequence``: whether
    sequence parallelism is on."""
    kind = type(module).__name__
    what = f"{name!r} (PEFT {kind}"
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        raise ValueError(
            f"{what}) is a PEFT tuner layer other than LoRA, whose extra weights pipe_tp cannot slice with "
            "its base layer; leave it out of the tensor-parallel plan (it stays whole), leave it out of "
            "the PEFT config's target_modules, or use tensor_parallel_size=1."
        )
    problem = None
    if not supported:
        problem = (
            f"is given the style {style_value!r}; pipe_tp slices LoRA adapters with a 'colwise' or "
            "'rowwise' base Linear only. Leave it out of the PEFT config's target_modules (or out of the "
            "plan)"
        )
    elif sequence:
        problem = (
            "is a LoRA layer under sequence_parallel=True, where its adapters would see this rank's part "
            "of the sequence; use sequence_parallel=False"
        )
    elif getattr(module, "merged", False):
        problem = "has its adapter merged into the base layer; unmerge it (model.unmerge_adapter()) first"
    elif any(len(getattr(module, attr, None) or {}) for attr in ("lora_embedding_A", "lora_variant")):
        problem = (
            "uses a LoRA variant (DoRA, ...) or embedding adapters, whose extra weights pipe_tp does not "
            "slice; use plain LoRA (use_dora=False) or tensor_parallel_size=1"
        )
    elif any(not isinstance(m, nn.Linear) for m in (*lora_a.values(), *lora_b.values())):
        problem = "holds adapters that are not Linear layers; use tensor_parallel_size=1"
    if problem is not None:
        raise ValueError(f"The tensor-parallel plan entry {what}) {problem}.")


def adapter_parts(module: nn.Module) -> list[tuple[str, Any, Any, Any]]:
    """Each adapter of a LoRA layer: its name, ``lora_A``, ``lora_B`` and ``lora_dropout``
    ModuleDicts (the replacements go into these under the adapter's name)."""
    lora_a: Any = module.lora_A
    return [(a, module.lora_A, module.lora_B, module.lora_dropout) for a in lora_a]
