"""Skip connections sent straight to the stage that pops them, against threading them through
every stage in between (what a pipe_tp user had to write before ``Stash`` / ``Pop``).

The example U-Net (``examples/skips/models.py``, wider: channels 16/32/64/64 on 32x32 images) at
pp=4 (two blocks per stage) under 1F1B, on 4 gloo processes, the same weights both ways:

* **skips**: ``Stash`` on the down blocks and ``Pop`` on the up blocks; ``x1`` goes from stage 0
  straight to stage 3, ``x2`` from stage 0 to stage 2, ``x3`` from stage 1 to stage 2.
* **threaded**: each block takes and returns a tuple that carries the skips still needed, so
  ``x1`` crosses stages 1 and 2 on its way to stage 3 (and its gradient comes back the same way).

Per rank: tensor bytes sent in one step (activations, skips and gradients; headers left out:
``P2PTransport.bytes_sent``), the most bytes held for backward at once (``peak_held_bytes``: what
autograd saved plus the inputs, outputs and popped tensors kept until backward, which a block that
only passes a tensor on never saves), and the step time (median of the timed steps; consecutive
steps, one barrier before the first). The two variants' losses and gradients are checked equal.

Run: ``python benchmarks/skip_connections.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import emit_json, launch, print_table, warn_if_busy
from torch import nn

from lightning_pipe.batches import signature
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.schedule import build_schedule
from lightning_pipe.skip.plan import SkipPlan

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "skips" / "models.py"
STAGES, LAYERS_PER_STAGE = 4, 2


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("skip_models", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["skip_models"] = module
    spec.loader.exec_module(module)
    return module


class Threaded(nn.Module):
    """A U-Net block in the threaded style: ``(y, *skips)`` in, ``(y', *skips')`` out."""

    def __init__(self, block: nn.Module, keeps: bool, pops: bool) -> None:
        super().__init__()
        self.block, self.keeps, self.pops = block, keeps, pops

    def forward(self, y: torch.Tensor, *skips: torch.Tensor) -> Any:
        if self.pops:
            y = self.block(y, skips[-1])
            skips = skips[:-1]
        else:
            y = self.block(y)
        out = (y, *skips, y) if self.keeps else (y, *skips)
        return out if len(out) > 1 else out[0]


def _layers(unet: nn.Module, threaded: bool) -> list[nn.Module]:
    if not threaded:
        return list(unet.configure_pipeline())
    blocks = [unet.inc, unet.down1, unet.down2, unet.down3, unet.up1, unet.up2, unet.up3, unet.outc]
    return [Threaded(b, keeps=k < 3, pops=4 <= k < 7) for k, b in enumerate(blocks)]


def worker(threaded: bool, batch: int, size: int, m: int, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    unet = _example().UNet(channels=(16, 32, 64, 64))
    layers = _layers(unet, threaded)
    plan = SkipPlan.of_layers(layers)
    mine = range(rank * LAYERS_PER_STAGE, (rank + 1) * LAYERS_PER_STAGE)
    routes = plan.routes(lambda k: k // LAYERS_PER_STAGE)
    executor = PipelineExecutor(
        {rank: [layers[k] for k in mine]},
        STAGES,
        list(range(STAGES)),
        torch.device("cpu"),
        skips=routes,
        skip_declarations={rank: plan.declared_by(mine)},
    )
    executor.measure_activation_memory = True
    schedule = build_schedule("1f1b", STAGES, m, skips=[(r.producer, r.consumer) for r in routes])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, size, size, generator=g)
    target = torch.randn(batch, 1, size, size, generator=g)
    inputs, targets = list(x.chunk(m)), list(target.chunk(m))

    def head(out: torch.Tensor, i: int) -> torch.Tensor:
        return F.mse_loss(out, targets[i])

    def step() -> Any:
        for p in unet.parameters():
            p.grad = None
        return executor.run(
            schedule,
            rank,
            inputs=inputs if rank == 0 else None,
            head=head if rank == STAGES - 1 else None,
            signatures=[signature(t) for t in inputs],
        )

    first = step()  # warm-up: gloo connections, headers; its gradients are compared
    grads = {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}
    losses = [float(v) for _, v in sorted(first.outputs.items())]
    dist.barrier()
    sent_before = executor.transport.bytes_sent
    times, held = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
        held = max(held, result.peak_held_bytes)
    return {
        "bytes_sent": (executor.transport.bytes_sent - sent_before) // steps,
        "peak_held_bytes": held,
        "step_s": statistics.median(times),
        "grads": grads,
        "losses": losses,
    }


def _mib(n: float) -> float:
    return n / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each variant once per round")
    args = parser.parse_args()
    warn_if_busy()
    results: dict[str, list[list[dict[str, Any]]]] = {"skips": [], "threaded": []}
    for _ in range(args.rounds):  # alternating, so that the machine's drift hits both alike
        for name in ("skips", "threaded"):
            run = launch(
                worker, STAGES, name == "threaded", args.batch, args.size, args.microbatches, args.steps
            )
            results[name].append(run)
    skips, threaded = results["skips"][0], results["threaded"][0]
    same = (
        all(
            torch.allclose(s["grads"][n], t["grads"][n], atol=1e-6, rtol=0)
            for s, t in zip(skips, threaded, strict=True)
            for n in s["grads"]
        )
        and skips[-1]["losses"] == threaded[-1]["losses"]
    )
    rows, report = [], {"same_gradients": same, "ranks": []}
    for rank in range(STAGES):

        def best(name: str, key: str, r: int = rank) -> float:
            return min(run[r][key] for run in results[name])

        row = {
            "rank": rank,
            "skips_sent_mib": _mib(best("skips", "bytes_sent")),
            "threaded_sent_mib": _mib(best("threaded", "bytes_sent")),
            "skips_held_mib": _mib(best("skips", "peak_held_bytes")),
            "threaded_held_mib": _mib(best("threaded", "peak_held_bytes")),
            "step_ratio": best("skips", "step_s") / best("threaded", "step_s"),
        }
        report["ranks"].append(row)
        rows.append([
            str(rank),
            f"{row['skips_sent_mib']:.2f}",
            f"{row['threaded_sent_mib']:.2f}",
            f"{row['skips_held_mib']:.2f}",
            f"{row['threaded_held_mib']:.2f}",
            f"{row['step_ratio']:.3f}",
        ])  # fmt: skip
    total = {name: sum(results[name][0][r]["bytes_sent"] for r in range(STAGES)) for name in results}
    report["total_sent_ratio"] = total["skips"] / total["threaded"]
    if args.json:
        emit_json(report)
        return
    print(
        f"U-Net at pp={STAGES} (1F1B, {args.microbatches} micro-batches of {args.batch // args.microbatches} "
        f"images {args.size}x{args.size}), best of {args.rounds} rounds; same losses and gradients: {same}"
    )
    print_table(
        [
            "rank",
            "sent MiB skips",
            "sent MiB threaded",
            "held MiB skips",
            "held MiB threaded",
            "step skips/threaded",
        ],
        rows,
    )
    print(f"bytes sent per step, all ranks: skips / threaded = {report['total_sent_ratio']:.3f}")


if __name__ == "__main__":
    main()
