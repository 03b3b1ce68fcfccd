"""A pp=2 fit that runs until something stops it, for the signal tests.

Each rank writes its pid to ``PID_DIR/rank{global_rank}`` once training runs, so that a test can
signal it. Run as a script (``python tests/long_fit.py PID_DIR``) it is started the way users start
Lightning (``python train.py``): Lightning's launcher starts rank 1 as a child of rank 0.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_pipe import PipeTPStrategy
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import quiet_trainer

DEADLINE = timedelta(seconds=120)
"""The exchange deadline: a signal must stop every rank far sooner than this."""


class WritePid(L.Callback):
    def __init__(self, pid_dir: str) -> None:
        self.pid_dir = pid_dir

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            Path(self.pid_dir, f"rank{trainer.global_rank}").write_text(str(os.getpid()))


def fit_until_stopped(pid_dir: str) -> None:
    torch.set_num_threads(1)
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=DEADLINE)
    trainer = quiet_trainer(strategy, 2, pid_dir, max_steps=1_000_000, callbacks=[WritePid(pid_dir)])
    trainer.fit(Regressor(), loader(dataset(64, seed=1), 8, reference=False))


if __name__ == "__main__":
    fit_until_stopped(sys.argv[1])
