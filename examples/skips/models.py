"""Two models with skip connections across pipeline stages, written for ``pipe_tp``.

* :class:`UNet`: a small U-Net denoiser (the backbone of most diffusion models). Its ``forward``
  is written the natural way, keeping ``x1``, ``x2``, ``x3`` on the way down and handing them to
  the up blocks; ``configure_pipeline`` lists the same blocks and says which output each down block
  stashes (:class:`~lightning_pipe.Stash`) and which skip each up block pops
  (:class:`~lightning_pipe.Pop`), so the pipeline sends ``x1`` from the first stage straight to
  the last, past every stage in between.
* :class:`Seq2Seq`: an encoder-decoder transformer whose every decoder layer attends to the
  encoder's output. Its blocks declare their skips themselves (:func:`~lightning_pipe.skippable`,
  torchgpipe's style): the source embedding stashes the target tokens, the bridge after the
  encoder stashes the encoder output ``memory`` and pops the target tokens, and every decoder layer
  pops ``memory``. One stash, popped by the decoder layers of every later stage.

Both train unchanged with ``strategy="auto"``: outside a pipeline, stash and pop pass the tensors
within one forward.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_pipe import Pop, Stash, pop, skippable, stash
from lightning_pipe.skip import skip_scope

# ----------------------------------------------------------------------------- U-Net


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1), nn.GELU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.GELU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.block = ConvBlock(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(F.avg_pool2d(x, 2))


class Up(nn.Module):
    """Upsample, concatenate the skip from the down path, convolve."""

    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.block = ConvBlock(c_in + c_skip, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.block(torch.cat([x, skip], dim=1))


class UNet(L.LightningModule):
    """Denoises 1-channel images: input a noisy image, output the clean one."""

    def __init__(self, channels: tuple[int, ...] = (4, 8, 8, 16), lr: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        c0, c1, c2, c3 = channels
        self.inc = ConvBlock(1, c0)
        self.down1, self.down2, self.down3 = Down(c0, c1), Down(c1, c2), Down(c2, c3)
        self.up1, self.up2, self.up3 = Up(c3, c2, c2), Up(c2, c1, c1), Up(c1, c0, c0)
        self.outc = nn.Conv2d(c0, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        y = self.down3(x3)
        y = self.up1(y, x3)
        y = self.up2(y, x2)
        y = self.up3(y, x1)
        return self.outc(y)

    def configure_pipeline(self) -> list[nn.Module]:
        # The same blocks in the same order; the wrappers say what travels past the stages between.
        return [
            Stash("x1", self.inc),
            Stash("x2", self.down1),
            Stash("x3", self.down2),
            self.down3,
            Pop("x3", self.up1),
            Pop("x2", self.up2),
            Pop("x1", self.up3),
            self.outc,
        ]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        noisy, clean = batch
        loss = F.mse_loss(self(noisy), clean)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        noisy, clean = batch
        self.log("val_loss", F.mse_loss(self(noisy), clean), prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def shapes_dataset(n: int, size: int = 16, seed: int = 0) -> TensorDataset:
    """Images of random bright rectangles, and the same images with Gaussian noise added."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.zeros(n, 1, size, size)
    for k in range(n):
        top, left = torch.randint(0, size // 2, (2,), generator=g).tolist()
        h, w = torch.randint(2, size // 2, (2,), generator=g).tolist()
        clean[k, 0, top : top + h, left : left + w] = 1.0
    noisy = clean + 0.3 * torch.randn(clean.shape, generator=g)
    return TensorDataset(noisy, clean)


# ----------------------------------------------------------------------------- encoder-decoder


class Attention(nn.Module):
    """Multi-head attention whose projections split across tensor ranks by whole heads: the query
    and key/value projections order their output features head-major, and the number of local
    heads is read from the (possibly column-split) projection."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.head_dim, self.causal = d_model // n_heads, causal
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)  # head-major: [k0 v0 | k1 v1 | ...]
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = self.q.out_features // self.head_dim
        q = self.q(x).view(b, s, heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], heads, 2, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


def _mlp(d_model: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = Attention(d_model, n_heads), _mlp(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h)
        return x + self.mlp(self.ln2(x))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder's output, MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.self_attn = Attention(d_model, n_heads, causal=True)
        self.cross_attn = Attention(d_model, n_heads)
        self.mlp = _mlp(d_model)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.self_attn(h, h)
        x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


@skippable(stash=["target"])
class SourceEmbedding(nn.Module):
    """Embeds the source tokens; the target tokens go straight to the bridge after the encoder."""

    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        stash("target", target)
        return self.tokens(source) + self.positions(torch.arange(source.shape[1], device=source.device))


@skippable(stash=["memory"], pop=["target"])
class Bridge(nn.Module):
    """Ends the encoder (its output, ``memory``, is stashed for every decoder layer) and starts the
    decoder from the target tokens."""

    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash("memory", self.norm(x))
        target = pop("target")
        return self.tokens(target) + self.positions(torch.arange(target.shape[1], device=target.device))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class Seq2Seq(L.LightningModule):
    """Learns to reverse a token sequence (teacher forcing: the decoder reads the shifted target)."""

    def __init__(
        self,
        vocab: int = 16,
        d_model: int = 32,
        n_heads: int = 4,
        encoder_layers: int = 2,
        decoder_layers: int = 4,
        max_len: int = 16,
        lr: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.source = SourceEmbedding(vocab, d_model, max_len)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, n_heads) for _ in range(encoder_layers))
        self.bridge = Bridge(vocab, d_model, max_len)
        self.decoder = nn.ModuleList(DecoderLayer(d_model, n_heads) for _ in range(decoder_layers))
        self.head = Head(d_model, vocab)

    def configure_pipeline(self) -> list[nn.Module]:
        return [
            self.source,
            *self.encoder,
            self.bridge,
            *(Pop("memory", layer) for layer in self.decoder),
            self.head,
        ]

    def pipeline_input(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        source, target_in, _ = batch
        return source, target_in

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {
            "encoder.*.attn.q": "colwise",
            "encoder.*.attn.kv": "colwise",
            "encoder.*.attn.proj": "rowwise",
            "encoder.*.mlp.0": "colwise",
            "encoder.*.mlp.2": "rowwise",
            "decoder.*.*_attn.q": "colwise",
            "decoder.*.*_attn.kv": "colwise",
            "decoder.*.*_attn.proj": "rowwise",
            "decoder.*.mlp.0": "colwise",
            "decoder.*.mlp.2": "rowwise",
        }

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with skip_scope():  # the blocks stash and pop within this call
            x = self.source(source, target)
            for layer in self.encoder:
                x = layer(x)
            y = self.bridge(x)
            memory = pop("memory")
            for layer in self.decoder:
                y = layer(y, memory)
            return self.head(y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        source, target_in, target_out = batch
        logits = self(source, target_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target_out.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        source, target_in, target_out = batch
        logits = self(source, target_in)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target_out.reshape(-1)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def reversal_dataset(n: int, length: int = 8, vocab: int = 16, seed: int = 0) -> TensorDataset:
    """Source sequences of tokens 2..vocab-1; the target is the source reversed, read by the decoder
    after a start token (1)."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(2, vocab, (n, length), generator=g)
    target = source.flip(1)
    target_in = torch.cat([torch.ones(n, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return TensorDataset(source, target_in, target)
