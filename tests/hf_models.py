"""A Hugging Face ``LlamaForCausalLM`` trained under pipe_tp the way a user would wrap it.

The model is kept whole as ``self.llama`` (so ``forward`` and checkpoints are plain Hugging Face),
and the pipeline is a second view of the same modules: ``self.pipe`` holds wrappers around
``llama.model.embed_tokens``, each ``llama.model.layers[i]`` and the final norm with ``lm_head``.
The tensor-parallel plan is Llama's own ``base_model_tp_plan``, prefixed with ``llama.model.``, so
it names modules by their Hugging Face names, not by the pipeline's: the strategy must resolve
them by identity.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 32, 8


def tiny_config(tied: bool = False) -> LlamaConfig:
    return LlamaConfig(
        tie_word_embeddings=tied,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",  # causal without a mask (eager attention would need one)
    )


class EmbedStage(nn.Module):
    """Token embedding plus the rotary tables, which travel along the pipeline as side inputs."""

    def __init__(self, llama: LlamaForCausalLM) -> None:
        super().__init__()
        self.embed_tokens = llama.model.embed_tokens
        self.rotary_emb = llama.model.rotary_emb

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        return hidden, cos, sin


class DecoderStage(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
        return (out[0] if isinstance(out, tuple) else out), cos, sin


class HeadStage(nn.Module):
    def __init__(self, llama: LlamaForCausalLM) -> None:
        super().__init__()
        self.norm = llama.model.norm
        self.lm_head = llama.lm_head

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class LlamaLM(L.LightningModule):
    def __init__(
        self, seed: int | None = 0, lr: float = 0.1, tied: bool = False, hf_plan: bool = False
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.llama = LlamaForCausalLM(tiny_config(tied))
        self.hf_plan = hf_plan
        self.pipe = nn.ModuleList(
            [EmbedStage(self.llama), *map(DecoderStage, self.llama.model.layers), HeadStage(self.llama)]
        )
        self.lr = lr

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.pipe)

    def tensor_parallel_plan(self) -> dict[str, str]:
        if self.hf_plan:  # the causal LM's own plan as it ships (Hugging Face style names)
            return {f"llama.{pattern}": style for pattern, style in self.llama._tp_plan.items()}
        plan = self.llama.config.base_model_tp_plan
        return {f"llama.model.{pattern}": style for pattern, style in plan.items()}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Plain Hugging Face: equal to the pipeline's chain, which pipe_tp checks numerically.
        return self.llama(ids).logits

    def _loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).reshape(-1, VOCAB), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def llama_data(n: int, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class MetaLlamaLM(LlamaLM):
    """The tied Llama built in configure_model() (meta device under pipe_tp) from its config, with
    Hugging Face's own initialisation for the modules that have no reset_parameters() (RMSNorm)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.hf_plan = 0.1, True
        self.llama: LlamaForCausalLM | None = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.llama is not None:
            return
        self.llama = LlamaForCausalLM(tiny_config(tied=True))
        self.pipe = nn.ModuleList(
            [EmbedStage(self.llama), *map(DecoderStage, self.llama.model.layers), HeadStage(self.llama)]
        )

    def init_module_weights(self, module: nn.Module) -> None:
        assert self.llama is not None
        self.llama._init_weights(module)
