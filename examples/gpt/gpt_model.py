"""A small GPT-style character language model written for ``pipe_tp``.

The model is a list of layers (embedding, transformer blocks, head) that ``configure_pipeline``
returns, so the strategy can cut it into stages; the same module trains unchanged with
``strategy="auto"``. The layers are created in ``configure_model()``, so that under ``pipe_tp`` no
rank ever holds the whole model: each materialises only its own stage.

Attention is written so that its projections can later be split across tensor-parallel ranks:
the fused QKV projection orders its output features head-major (``[q_h, k_h, v_h]`` for head 0,
then head 1, ...), so a contiguous column split keeps whole heads, and the number of local heads
is read from the projection's output size rather than stored. ``tensor_parallel_plan`` shards it the
Megatron way: vocab-parallel embedding and loss, column-parallel QKV and first MLP layer,
row-parallel output projections.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from char_data import VOCAB_SIZE
from torch import nn

from lightning_pipe.tensor_parallel import cross_entropy, gather_vocab

# The model's vocabulary is the alphabet padded to a multiple of 8, so that tensor-parallel sizes
# 2, 4 and 8 divide it (the padding classes are never targets and learn to stay unlikely).
MODEL_VOCAB = -(-VOCAB_SIZE // 8) * 8


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)  # head-major: [q0 k0 v0 | q1 k1 v1 | ...]
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.qkv.out_features // (3 * self.head_dim)  # local heads: works on a column shard
        q, k, v = self.qkv(x).view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class CharGPT(L.LightningModule):
    """Next-character prediction; logs train/val loss and a torchmetrics accuracy."""

    def __init__(
        self,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 4,
        max_len: int = 256,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers: nn.ModuleList | None = None  # built in configure_model()
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(
            num_classes=MODEL_VOCAB, average="micro"
        )

    def configure_model(self) -> None:
        """Lightning's hook for large models: under ``pipe_tp`` the layers' parameters are created
        on the meta device (no memory) and each rank materialises only its own stage and tensor
        slice; under ``strategy="auto"`` they are built as usual. Every Trainer call runs the hook,
        so it builds once."""
        if self.layers is not None:
            return
        hp = self.hparams
        self.layers = nn.ModuleList(
            [Embedding(MODEL_VOCAB, hp.d_model, hp.max_len)]
            + [Block(hp.d_model, hp.n_heads) for _ in range(hp.n_layers)]
            + [Head(hp.d_model, MODEL_VOCAB)]
        )

    def configure_pipeline(self) -> list[nn.Module]:
        assert self.layers is not None, "configure_model() builds the layers"
        return list(self.layers)

    def tensor_parallel_plan(self) -> dict[str, str]:
        last = self.hparams.n_layers + 1
        return {
            "layers.0.tokens": "vocab",
            "layers.*.attn.qkv": "colwise",
            "layers.*.attn.proj": "rowwise",
            "layers.*.mlp.0": "colwise",
            "layers.*.mlp.2": "rowwise",
            f"layers.{last}.out": "colwise_logits",
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None, "configure_model() builds the layers"
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        # lightning_pipe.tensor_parallel.cross_entropy: vocab-parallel on sharded logits,
        # F.cross_entropy otherwise.
        loss = cross_entropy(self(ids), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, targets = batch
        logits = self(ids)
        self.log("val_loss", cross_entropy(logits, targets), prog_bar=True)
        full = gather_vocab(logits)  # the accuracy needs every class's logit
        self.val_accuracy.update(full.reshape(-1, full.shape[-1]), targets.reshape(-1))
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / max(1, self.hparams.warmup_steps))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
