"""Tiny, randomly initialised Hugging Face causal LMs of several families (CPU, no download), the
batches they train on (padded, packed), and a single-process reference training loop.

Each family exercises layers of another kind: sliding-window attention (mistral, cohere2),
per-head query/key norms whose tensor-parallel gradients must be summed (qwen3), logit and
attention soft-capping with a scaled embedding and eager attention (gemma2), one rotary table per
layer type (gemma3_text), fused projections that its plan gathers (phi3), other module names with
an embedding dropout (gpt_neox), four multipliers (granite), and a mixture of experts (mixtral).
Norm weights and biases are perturbed so that no comparison passes by symmetry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from lightning_pipe.huggingface.outputs import causal_lm_loss

VOCAB, SEQ = 96, 10  # a vocabulary that tensor sizes 2 and 4 divide

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


@dataclass(frozen=True)
class Family:
    config: str
    model: str
    overrides: dict[str, Any] = field(default_factory=dict)
    attention: str = "sdpa"
    float64: bool = True
    """Whether its own forward runs in float64 (compared to 1e-9 then, else in float32 to 1e-5)."""


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, pad_token_id=0)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM"),
    # Eager only; its eager softmax runs in float32, so float64 padding gives NaN in its own forward.
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=5,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,
            query_pre_attn_scalar=8,
            pad_token_id=0,
        ),
        attention="eager",
        float64=False,
    ),
    # Its norms compute in float32 whatever the model's dtype.
    "gemma3_text": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=5,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=8,
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        float64=False,
    ),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=None, head_dim=None)),
    "granite": Family(
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3),
    ),
    "cohere2": Family(
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(
            logit_scale=0.5,
            sliding_window=5,
            pad_token_id=0,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    ),
    # Experts by grouped matrix products, which have no float64 kernel.
    "mixtral": Family(
        "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), float64=False
    ),
}


def config(family: str) -> Any:
    spec = FAMILIES[family]
    values = {k: v for k, v in {**COMMON, **spec.overrides}.items() if v is not None}
    made = getattr(transformers, spec.config)(**values)
    made._attn_implementation = spec.attention
    made.use_cache = False
    return made


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """The family's tiny causal LM, equal in every process for a seed, in train mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].model)(config(family))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model.to(dtype).train()


def padded_batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of random lengths (at least 2), labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (size,), generator=g)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    """Several sequences per row, told apart by position ids restarting at 0 (no attention mask);
    the first token of each sequence is not a target of the one before (label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=g)
    positions = torch.empty(size, SEQ, dtype=torch.long)
    labels = ids.clone()
    for row in range(size):
        start = 0
        while start < SEQ:
            length = int(torch.randint(2, 6, (1,), generator=g))
            end = min(SEQ, start + length)
            positions[row, start:end] = torch.arange(end - start)
            if start > 0:
                labels[row, start] = -100
            start = end
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


BATCHES = {"padded": padded_batch, "packed": packed_batch}


def batches(kind: str, steps: int, size: int) -> list[dict[str, torch.Tensor]]:
    return [BATCHES[kind](size, seed=100 + step) for step in range(steps)]


def reference_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own forward on the whole batch (training semantics: no cache), and Hugging
    Face's causal-LM loss computed in the model's precision (``ForCausalLMLoss`` casts to float32,
    which would hide float64 differences)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return causal_lm_loss(logits, batch["labels"])


def train_reference(model: nn.Module, steps: list[dict[str, torch.Tensor]], lr: float) -> dict[str, Any]:
    """One process, whole batches, SGD: the losses, the first step's gradients, the last weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step, batch in enumerate(steps):
        optimizer.zero_grad()
        loss = reference_loss(model, batch)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(float(loss.detach()))
    last = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "last": last}
