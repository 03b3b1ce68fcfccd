"""A tiny GPT written for pipe_tp with a tensor-parallel plan (vocab-parallel embedding and loss,
head-major fused QKV attention, Megatron MLP), used by the tensor-parallel tests; ``LateGPT`` is
the same model built in ``configure_model()`` (on the meta device under pipe_tp)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_pipe.tensor_parallel import cross_entropy

VOCAB, DIM, HEADS, SEQ = 16, 16, 4, 8


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(SEQ, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))


class Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, DIM // HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)  # head-major: [q0 k0 v0 | q1 k1 v1 | ...]
        self.proj = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.qkv.out_features // (3 * self.head_dim)  # local heads under tensor parallelism
        q, k, v = self.qkv(x).view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(dropout)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class TinyGPT(L.LightningModule):
    def __init__(self, dropout: float = 0.0, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Embed(), Block(dropout), Block(dropout), Head()])
        self.lr = lr

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {
            "layers.0.tokens": "vocab",
            "layers.*.attn.qkv": "colwise",
            "layers.*.attn.proj": "rowwise",
            "layers.*.attn.drop": "dropout",
            "layers.*.mlp.0": "colwise",
            "layers.*.mlp.2": "rowwise",
            "layers.3.out": "colwise_logits",
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        loss = cross_entropy(self(ids), targets)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        # SGD, not Adam: the key bias has a zero true gradient (softmax ignores a shift shared by
        # all keys), and Adam would turn its rounding noise into lr-sized steps that differ
        # between any two summation orders, sharded or not.
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


SEQUENCE_PLAN = {
    "layers.0": "sequence_scatter",
    "layers.0.tokens": "vocab",
    "layers.*.ln1": "sequence",
    "layers.*.ln2": "sequence",
    "layers.*.attn": "sequence_gather",
    "layers.*.attn.qkv": "colwise",
    "layers.*.attn.proj": "rowwise",
    "layers.*.mlp.0": "colwise",
    "layers.*.mlp.2": "rowwise",
    "layers.*.drop": "sequence",
    "layers.3.ln": "sequence",
    "layers.3.out": "colwise_logits",
}
"""TinyGPT's plan under sequence parallelism: the sequence split after the vocab-parallel embedding
(layer 0), norms and residual dropouts on each rank's part, the attention gathered once for its
projections, the MLP gathering its input itself, and the head's logits column-parallel (layer 3)."""


def token_data(n: int, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class LateGPT(TinyGPT):
    """TinyGPT whose layers are created in ``configure_model()`` (Lightning's large-model hook),
    optionally with the output head tied to the token embedding."""

    def __init__(self, tied: bool = False, build_now: bool = False) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.tied = 0.1, tied
        self.layers: nn.ModuleList | None = None  # type: ignore[assignment]
        if build_now:
            self.configure_model()

    def configure_model(self) -> None:
        if self.layers is not None:  # every Trainer call runs the hook: build once
            return
        self.layers = nn.ModuleList([Embed(), Block(0.0), Block(0.0), Head()])
        if self.tied:
            self.layers[3].out.weight = self.layers[0].tokens.weight

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, targets = batch
        self.log("val_loss", cross_entropy(self(ids), targets))
