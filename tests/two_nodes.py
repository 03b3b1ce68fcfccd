"""A tiny GPT at pp=2 x tp=2 for the several-nodes tests (``tests/test_nodes.py``), as a script.

Run under a launcher that makes the nodes (``torchrun --nnodes 2``, Lightning's own launcher with
``NODE_RANK``, SLURM's variables): ``python tests/two_nodes.py --root DIR --nodes 2 --devices 2
[--save] [--resume] [--epochs N] [--until-killed]``. Global rank 0 writes the loss of each global
step, Lightning's cluster environment and each rank's node rank to ``DIR/losses-{--tag}.json``;
``--save`` writes the sharded checkpoint ``DIR/two-nodes.ckpt`` at each epoch's end (every rank
its part, into one directory); ``--resume`` continues from it; ``--until-killed`` trains until
something stops it, each rank writing ``DIR/pids/rank{r}.json`` (its pid, node rank and
launcher's pid) once training runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_pipe import PipeTPStrategy
from tests.gpt_models import TinyGPT, token_data
from tests.trainers import quiet_trainer

SAMPLES, BATCH = 32, 8  # four steps an epoch
CHECKPOINT = "two-nodes.ckpt"


class Record(L.Callback):
    """Each global step's loss (written by global rank 0 at the end); with ``pid_dir``, each rank's
    pid, node rank and parent (the launcher) once training runs."""

    def __init__(self, out: Path, pid_dir: Path | None) -> None:
        self.out, self.pid_dir = out, pid_dir
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])
        if self.pid_dir is not None and trainer.global_step == 3:
            where = {"pid": os.getpid(), "node": trainer.node_rank, "launcher": os.getppid()}
            path = self.pid_dir / f"rank{trainer.global_rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(where))
            path.with_suffix(".tmp").rename(path)

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        if trainer.global_rank == 0:
            strategy: Any = trainer.strategy
            nodes = strategy.mesh.nodes.node_ranks if strategy.mesh.nodes is not None else None
            environment = type(strategy.cluster_environment).__name__
            self.out.write_text(
                json.dumps({"losses": self.losses, "environment": environment, "nodes": nodes})
            )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--until-killed", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pid_dir = args.root / "pids" if args.until_killed else None
    if pid_dir is not None:
        pid_dir.mkdir(parents=True, exist_ok=True)
    callbacks: list[Any] = [Record(args.root / f"losses-{args.tag}.json", pid_dir)]
    settings: dict[str, Any] = {
        "num_nodes": args.nodes,
        "max_epochs": -1 if args.until_killed else args.epochs,
    }
    if args.save:
        callbacks.append(ModelCheckpoint(dirpath=args.root, filename=Path(CHECKPOINT).stem))
        settings["enable_checkpointing"] = True
    strategy = PipeTPStrategy(
        pipeline_parallel_size=args.pp,
        tensor_parallel_size=args.tp,
        num_microbatches=2,
        timeout=timedelta(seconds=60),
    )
    trainer = quiet_trainer(strategy, args.devices, str(args.root / "logs"), callbacks=callbacks, **settings)
    ckpt = str(args.root / CHECKPOINT) if args.resume else None
    trainer.fit(TinyGPT(), DataLoader(token_data(SAMPLES), batch_size=BATCH), ckpt_path=ckpt)


if __name__ == "__main__":
    main(sys.argv[1:])
