"""A small LightningModule written the way the pipe_tp contract asks, used by the strategy tests.

The same class, unchanged, trains under ``strategy="auto"`` (the single-device reference) and
under ``pipe_tp``; the tests compare the two.
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
