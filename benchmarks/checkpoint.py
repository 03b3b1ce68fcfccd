"""Sharded checkpoints against one gathered file: time to save, the most one rank writes, loading.

A stack of Megatron MLP blocks (``Linear(d, 4d)`` column-parallel, GELU, ``Linear(4d, d)``
row-parallel), one block per pipeline layer, is fitted for two steps with Adam (so every parameter
has two moment tensors) at pp=2 x tp=2 on four gloo processes. Then, in the same processes:

* ``sharded``: ``trainer.save_checkpoint(dir)`` with the default ``save_distributed_checkpoint=True``,
  every rank writing its own shard file;
* ``gathered``: the same call with ``save_distributed_checkpoint=False``: the whole model and
  optimizer state gathered onto global rank 0, which writes one file;

alternating, ``--repeats`` times each; the table gives the median wall time of the call on rank 0
(every rank leaves the call together) and the largest file one rank wrote. Then loading:
``strategy.load_checkpoint`` of the sharded directory at the layout that wrote it (each rank reads
its own stage, memory-mapped, and cuts its slices), and ``consolidate_checkpoint`` of it in one
process (what a user runs for inference).

Run: ``python benchmarks/checkpoint.py`` (table) or ``--json``; ``--width`` and ``--blocks`` size
the model (default 512 x 8: 16.8 M parameters, 201 MB of weights and Adam state). No target: the
figures show what sharding buys (no rank holds or writes the whole state) and what it costs.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _launch import emit_json, launch, median, print_table, warn_if_busy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint


class MLPStack(L.LightningModule):
    """``blocks`` Megatron MLP blocks of width ``width``, each one pipeline layer."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(blocks)
            ]
        )

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"layers.*.0": "colwise", "layers.*.2": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _largest_file(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return max(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def worker(root: str, width: int, blocks: int, repeats: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    strategy = PipeTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=root,
    )  # fmt: skip
    # Every rank of a pipeline must load the same batch (pipe_tp checks it): seed the data.
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g))
    trainer.fit(MLPStack(width, blocks), DataLoader(data, batch_size=8))
    times: dict[str, list[float]] = {"sharded": [], "gathered": []}
    largest: dict[str, int] = {}
    for _ in range(repeats):
        for kind in times:
            strategy.save_distributed_checkpoint = kind == "sharded"
            path = os.path.join(root, f"{kind}.ckpt")
            strategy.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            times[kind].append(time.perf_counter() - start)
            strategy.barrier()
            if trainer.is_global_zero:
                largest[kind] = _largest_file(path)
    strategy.save_distributed_checkpoint = True
    load = []
    for _ in range(repeats):
        strategy.barrier()
        start = time.perf_counter()
        strategy.load_checkpoint(os.path.join(root, "sharded.ckpt"))
        load.append(time.perf_counter() - start)
    total = sum(
        os.path.getsize(os.path.join(root, "sharded.ckpt", name))
        for name in os.listdir(os.path.join(root, "sharded.ckpt"))
    )
    return {
        "save_s": {k: median(v) for k, v in times.items()},
        "largest_file_bytes": largest,
        "sharded_total_bytes": total,
        "load_sharded_s": median(load),
        "parameters": sum(p.numel() for p in MLPStack(width, blocks).parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    with tempfile.TemporaryDirectory() as root:
        result = launch(worker, 4, root, args.width, args.blocks, args.repeats, timeout=600)[0]
        start = time.perf_counter()
        consolidate_checkpoint(os.path.join(root, "sharded.ckpt"), os.path.join(root, "consolidated.ckpt"))
        result["consolidate_s"] = time.perf_counter() - start
        result["consolidated_bytes"] = os.path.getsize(os.path.join(root, "consolidated.ckpt"))
    save, largest = result["save_s"], result["largest_file_bytes"]
    result["save_ratio_sharded_vs_gathered"] = save["sharded"] / save["gathered"]
    result["largest_file_ratio_sharded_vs_gathered"] = largest["sharded"] / largest["gathered"]
    if args.json:
        emit_json(result)
        return
    mb = 1e6
    print(f"{result['parameters']:,} parameters, Adam, pp=2 x tp=2 on 4 gloo processes\n")
    print_table(
        ["format", "save (s)", "largest file one rank wrote (MB)"],
        [
            ["sharded", save["sharded"], largest["sharded"] / mb],
            ["gathered (save_distributed_checkpoint=False)", save["gathered"], largest["gathered"] / mb],
            ["ratio sharded / gathered", result["save_ratio_sharded_vs_gathered"],
             result["largest_file_ratio_sharded_vs_gathered"]],
        ],
    )  # fmt: skip
    print()
    print_table(
        ["operation", "time (s)", "MB"],
        [
            ["load the sharded checkpoint at pp=2 x tp=2 (per rank)", result["load_sharded_s"],
             result["sharded_total_bytes"] / mb],
            ["consolidate it into one file (one process)", result["consolidate_s"],
             result["consolidated_bytes"] / mb],
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
