"""Train with ``ParallelRuntime`` alone (no Lightning): data x pipeline x tensor parallelism.

Run (8 CPU processes, gloo): ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8
examples/train_engine.py --dp 2 --pp 2 --tp 2``. A residual MLP is built on the meta device, split
into stages, its blocks sharded Megatron-style; each step clips by the global norm and the run
saves a sharded checkpoint (``--save-at``) that ``--resume`` continues from, at any layout.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.construction.meta import parameters_on_meta
from lightning_pipe.mesh import MeshAxis, ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def build_model() -> nn.Sequential:
    with parameters_on_meta("the example model"):  # no rank ever holds the whole model
        return nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(6)], nn.Linear(64, 1))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
    return x, torch.sin(3 * x @ torch.linspace(-1, 1, 16).unsqueeze(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for axis in ("dp", "pp", "tp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this step")
    parser.add_argument("--checkpoint", default="engine.ckpt", help="the sharded checkpoint directory")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--losses", default=None, help="write the losses here (JSON), from rank 0")
    parser.add_argument(
        "--shard-optimizer-state",
        action="store_true",
        help="ZeRO-1: each replica keeps 1/dp of AdamW's state",
    )
    parser.add_argument(
        "--shard-parameters",
        action="store_true",
        help="FSDP2 over the data axis: parameters, gradients and AdamW's state each 1/dp per rank",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_mesh(ParallelLayout(args.dp, args.pp, args.tp), "cpu")
    model = build_model()
    options = RuntimeOptions(
        num_microbatches=args.microbatches,
        schedule="1f1b",
        tensor_parallel_plan={"*.up": "colwise", "*.down": "rowwise"},
        shard_optimizer_state=args.shard_optimizer_state,
        shard_parameters=args.shard_parameters,
    )
    runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options, seed=0)
    # Built over the whole model, as one device would; the runtime keeps this rank's parameters.
    optimizer = runtime.keep_own(torch.optim.AdamW(model.parameters(), lr=3e-3))
    start = runtime.load_checkpoint(args.checkpoint, [optimizer])["step"] if args.resume else 0

    c, losses = mesh.coordinates, {}
    for step in range(start, args.steps):
        x, y = (t.chunk(args.dp)[c.dp_rank] for t in global_batch(step))  # this replica's share
        optimizer.zero_grad()
        runtime.begin_accumulation()
        # The runtime splits the batch into micro-batches; the head ends each one on the last stage.
        result = runtime.train_batch((x, y), lambda out, microbatch: F.mse_loss(out, microbatch.data[1]))
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        loss = torch.tensor(result.loss)  # every rank of the pipeline has it: average the replicas'
        dist.all_reduce(loss, group=mesh.group(MeshAxis.DATA))
        losses[step] = loss.item() / args.dp
        if step + 1 == args.save_at:
            runtime.save_checkpoint(args.checkpoint, [optimizer], {"step": step + 1})
    if dist.get_rank() == 0:
        ran = sorted(losses.items())
        for k, (step, loss) in enumerate(ran):
            if k < 3 or step % 10 == 0 or k == len(ran) - 1:  # the first steps (after a resume too)
                print(f"step {step:3d}  loss {loss:.5f}")
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
