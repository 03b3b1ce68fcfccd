"""Fine-tune (or pre-train) a Hugging Face causal LM with LightningCLI and ``pipe_tp``.

    python examples/huggingface/train.py fit --config examples/huggingface/configs/pipe_tp.yaml

``configs/pipe_tp.yaml``: 2 processes, pp=2; ``configs/pipe_tp_tp2.yaml``: 4 processes, pp=2 x tp=2;
``configs/single.yaml``: one process.

The module is ``lightning_pipe.CausalLMModule``: no wrapper and no plan written by hand; the
strategy derives the pipeline stages and the tensor-parallel plan from the model's own
``base_model_pp_plan`` and ``base_model_tp_plan``. The configs build a small Llama from a config
(random weights). For a model on disk (a ``save_pretrained`` directory, e.g. a Hub snapshot), give
it twice, so that each rank reads only its own stage's tensors:

    --model.model=/path/to/model --trainer.strategy.pretrained=/path/to/model

and turn the best checkpoint back into a Hugging Face directory afterwards:

    python -m lightning_pipe.consolidate runs/hf-pipe_tp/.../checkpoints/BEST.ckpt --to-huggingface out/
"""

from __future__ import annotations

import os

import torch
from byte_data import ByteTextDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_pipe import CausalLMModule


def main() -> None:
    if "OMP_NUM_THREADS" in os.environ:
        # Several processes share the CPU cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    LightningCLI(CausalLMModule, ByteTextDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
