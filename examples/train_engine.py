"""Train a small MLP with the bare pipeline engine (no Lightning) on 4 CPU processes with gloo.

Run: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/train_engine.py``.
Each process holds one stage of an 8-layer network; the last stage computes the loss and prints it.
This is the engine the ``pipe_tp`` Lightning strategy drives; it shows the pieces without a Trainer.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.pipeline.executor import PipelineExecutor
from lightning_pipe.pipeline.microbatch import signature, split_microbatches
from lightning_pipe.pipeline.partition import compute_balance, split_layers
from lightning_pipe.pipeline.render import render_schedule
from lightning_pipe.pipeline.schedules import build_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # every rank builds the same full model, then keeps its stage
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Tanh()]
    layers += [m for _ in range(3) for m in (nn.Linear(64, 64), nn.Tanh())]
    layers += [nn.Linear(64, 1)]
    balance = compute_balance(layers, p)
    stage = split_layers(layers, balance)[rank]
    params = [q for layer in stage for q in layer.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    executor = PipelineExecutor({rank: stage}, p, list(range(p)), torch.device("cpu"))
    schedule = build_schedule(args.schedule, p, args.microbatches)
    if rank == 0:
        print(f"balance (layers per stage): {balance}")
        print(render_schedule(schedule))

    target = torch.randn(16, 1)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # every rank draws the same batch
        x = torch.randn(64, 16, generator=g)
        y = torch.sin(x @ target)
        xs, ys = split_microbatches(x, args.microbatches), split_microbatches(y, args.microbatches)
        opt.zero_grad()
        result = executor.run(
            schedule,
            rank,
            inputs=xs,
            head=lambda out, i, ys=ys: F.mse_loss(out, ys[i]),
            signatures=[signature(t) for t in xs],
        )
        opt.step()
        if rank == p - 1 and step % 20 == 0:
            loss = sum(v.item() for v in result.outputs.values()) / args.microbatches
            print(f"step {step:4d}  loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
