"""Train the character-level GPT with LightningCLI.

    python examples/gpt/train.py fit --config examples/gpt/configs/single.yaml   # one process
    python examples/gpt/train.py fit --config examples/gpt/configs/pipe_tp.yaml  # 4 processes, pp=4

Lightning starts the other processes itself (or torchrun / SLURM start them). The strategy can
also be given on the command line: ``--trainer.strategy=lightning_pipe.PipeTPStrategy
--trainer.strategy.pipeline_parallel_size=2``.
"""

from __future__ import annotations

import os

import torch
from char_data import CharDataModule
from gpt_model import CharGPT
from lightning.pytorch.cli import LightningCLI

import lightning_pipe  # noqa: F401  (registers the "pipe_tp" strategy name)


def main() -> None:
    if "OMP_NUM_THREADS" in os.environ:
        # Several processes share the CPU cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    LightningCLI(CharGPT, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
