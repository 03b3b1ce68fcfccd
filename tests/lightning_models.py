"""Small LightningModules written the way the pipe_tp contract asks, used by the strategy tests.

The same class, unchanged, trains under ``strategy="auto"`` (the single-device reference) and
under ``pipe_tp``; the tests compare the two. ``Regressor`` is an MLP on ``dataset``; ``TiedLM``
ties its token embedding (first stage) to its output head (last stage), on ``TOKENS``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

IN, HIDDEN, OUT = 6, 16, 3


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05, step_lr: bool = True, clip_hook: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, OUT),
        )  # fmt: skip
        self.lr, self.step_lr = lr, step_lr
        self.train_mae = torchmetrics.MeanAbsoluteError()
        self.train_mse = torchmetrics.MeanSquaredError()
        self.val_mae = torchmetrics.MeanAbsoluteError()
        self.test_mae = torchmetrics.MeanAbsoluteError()

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self(x)
        loss = F.mse_loss(pred, y)
        self.train_mae(pred, y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("train_mae", self.train_mae, on_step=False, on_epoch=True)
        self.train_mse(pred, y)
        self.log("train_mse", self.train_mse)  # on_step: the batch's value, not the last micro-batch's
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        pred = self(x)
        self.val_mae.update(pred, y)
        self.log("val_loss", F.mse_loss(pred, y), prog_bar=True)
        self.log("val_mae", self.val_mae)
        self.log("val_loss_synced", F.l1_loss(pred, y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        pred = self(x)
        self.test_mae.update(pred, y)
        self.log("test_loss", F.mse_loss(pred, y))
        self.log("test_mae", self.test_mae)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.step_lr:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(n, OUT, generator=g))


def loader(ds: TensorDataset, batch: int, reference: bool) -> DataLoader:
    """Under pipe_tp Lightning injects a shuffling DistributedSampler over the data axis (size 1
    here); the single-device reference gets the same sampler explicitly, so both see one order."""
    if reference:
        return DataLoader(
            ds, batch_size=batch, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        )
    return DataLoader(ds, batch_size=batch)


# A second model, for tied weights: its own vocabulary, width and sequence length.
VOCAB, DIM, SEQ = 11, 8, 5


class TiedLM(L.LightningModule):
    """Token embedding on the first stage tied to the output head on the last."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if unused:
            self.blocks[1].add_module("never_called", nn.Linear(DIM, DIM))
            self.blocks[1] = _SkipUnused(self.blocks[1])

    def configure_pipeline(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).reshape(-1, VOCAB), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class _SkipUnused(nn.Module):
    def __init__(self, inner: nn.Sequential) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[1](self.inner[0](x))  # `never_called` never is


def _tokens(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(ids, torch.roll(ids, 1, dims=1))


TOKENS = _tokens(32)
