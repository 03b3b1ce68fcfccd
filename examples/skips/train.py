"""Train the skip-connection examples on CPU processes (gloo).

    python examples/skips/train.py --model unet --pp 4                  # U-Net, 4 stages, 1F1B
    python examples/skips/train.py --model seq2seq --pp 2 --tp 2        # encoder-decoder, 4 processes
    python examples/skips/train.py --model unet --pp 2 --schedule zb_h1 --recompute always

``--pp 1 --tp 1`` with ``--auto`` trains the same model with ``strategy="auto"`` on one process.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning as L
from models import Seq2Seq, UNet, reversal_dataset, shapes_dataset
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["unet", "seq2seq"], default="unet")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (processes per replica)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (seq2seq)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--recompute", default="never")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--auto", action="store_true", help='strategy="auto" on one process instead')
    args = parser.parse_args()
    if args.model == "unet":
        model: L.LightningModule = UNet()
        train, val = shapes_dataset(256, seed=0), shapes_dataset(64, seed=1)
    else:
        model = Seq2Seq()
        train, val = reversal_dataset(512, seed=0), reversal_dataset(64, seed=1)
    if args.auto:
        strategy: object = "auto"
        devices = 1
    else:
        strategy = PipeTPStrategy(
            pipeline_parallel_size=args.pp,
            tensor_parallel_size=args.tp,
            schedule=args.schedule,
            num_microbatches=args.microbatches,
            recompute=args.recompute,
            timeout=timedelta(seconds=120),
        )
        devices = args.pp * args.tp
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=8,
    )
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16))


if __name__ == "__main__":
    main()
