"""A fully sharded data axis (``shard_parameters=True``, torch's FSDP2) against the other ways of
using it: memory per rank, and step time beside replicated data parallelism, ZeRO-1 and
Lightning's own ``ModelParallelStrategy`` (FSDP2).

The same LightningModule (``--layers`` x Linear(``--width``) + ReLU, Adam) is fitted by a Trainer
in gloo processes (one intra-op thread each), global batch ``--batch``, one micro-batch per step at
pp=1 (the work ``ModelParallelStrategy`` does), two per stage with a pipeline.

* **Memory** (per rank, measured on the tensors each rank holds after an optimizer step):
  parameters + gradients + optimizer state. Replicated and ZeRO-1 keep gradients in the reducer's
  bucket buffers, which are counted instead. Goal for ``shard_parameters``: at most 1/(dp x pp) of
  one device's total plus one layer's unsharded parameters. Layouts: dp=2, dp=4 and dp=2 x pp=2.
* **Step time** at dp=2, pp=1: each set-up is fitted ``--rounds`` times in alternating order (one
  launch per fit); a fit's steps after the first ``--skip`` are summarised by their median and a
  set-up by its best fit (noise on a shared machine only adds time). Ratios to replicated data
  parallelism; goal: ``shard_parameters`` within 5% of ``ModelParallelStrategy``.

Run: ``python benchmarks/fully_sharded.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _launch import emit_json, launch, print_table, warn_if_busy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeTPStrategy

GOAL_RATIO = 1.05


class MLP(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class FullyShardedMLP(MLP):
    """The same model written for ``ModelParallelStrategy``: FSDP2 applied in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class _Measure(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.bytes: dict[str, int] = {}
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.bytes = _held_bytes(trainer, module)


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None or t.is_meta:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _held_bytes(trainer: L.Trainer, module: L.LightningModule) -> dict[str, int]:
    """What this rank holds after the step: parameters, gradients (or the buckets holding them)
    and optimizer state."""
    runtime = getattr(trainer.strategy, "_runtime", None)
    # Under pipe_tp, this rank's stage (an eagerly built model also keeps the other stages' layers,
    # untrained: build in configure_model() to avoid them); under ModelParallelStrategy, all.
    params = runtime.parameters if runtime is not None else [p for p in module.parameters() if not p.is_meta]
    reducer = getattr(getattr(runtime, "gradients", None), "reducer", None)
    if reducer is not None:  # gradients are views into (or slices of) the bucket buffers
        grads = sum(_local_bytes(b.buffer) for b in reducer._buckets)
    else:
        grads = sum(_local_bytes(p.grad) for p in params)
    state = sum(
        _local_bytes(v)
        for opt in trainer.optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"parameters": sum(_local_bytes(p) for p in params), "gradients": grads, "optimizer_state": state}


def _strategy(name: str, pp: int, world: int) -> Any:
    if name == "ModelParallelStrategy":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    options = {
        "replicated": {},
        "ZeRO-1": {"shard_optimizer_state": True},
        "shard_parameters": {"shard_parameters": True},
    }
    return PipeTPStrategy(
        pipeline_parallel_size=pp, num_microbatches=1 if pp == 1 else 2 * pp, **options[name]
    )


def fit_worker(name: str, pp: int, cfg: dict[str, Any]) -> dict[str, Any]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    n = cfg["batch"] * cfg["steps"]
    data = TensorDataset(torch.randn(n, cfg["width"], generator=g), torch.randn(n, cfg["width"], generator=g))
    dp = world // pp
    model = (FullyShardedMLP if name == "ModelParallelStrategy" else MLP)(cfg["width"], cfg["layers"])
    measure = _Measure()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy=_strategy(name, pp, world), accelerator="cpu", devices=world, max_steps=cfg["steps"],
            callbacks=[measure], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root,
        )  # fmt: skip
        trainer.fit(model, DataLoader(data, batch_size=cfg["batch"] // dp))
    return {"times": measure.times[cfg["skip"] :], "bytes": measure.bytes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed fit")
    parser.add_argument("--skip", type=int, default=10, help="first steps of a fit not timed")
    parser.add_argument("--rounds", type=int, default=4, help="timed fits per set-up, alternating")
    args = parser.parse_args()
    warn_if_busy()
    cfg = vars(args)
    width, layers = args.width, args.layers
    layer_bytes = (width * width + width) * 4
    total = 4 * layers * layer_bytes  # one device: parameters, gradients, Adam's two moments
    # Memory: a few steps per layout, the largest rank's total.
    short = {**cfg, "steps": 3, "skip": 0}
    memory = []
    for name in ("replicated", "ZeRO-1", "shard_parameters"):
        for dp, pp in ((2, 1), (4, 1), (2, 2)):
            ranks = launch(fit_worker, dp * pp, name, pp, short, init_group=False, timeout=600)
            held = max(ranks, key=lambda r: sum(r["bytes"].values()))["bytes"]
            memory.append({"setup": name, "dp": dp, "pp": pp, **held, "total": sum(held.values())})
    # Step time at dp=2, pp=1: alternating rounds.
    setups = ["replicated", "ZeRO-1", "shard_parameters", "ModelParallelStrategy"]
    fits: dict[str, list[float]] = {s: [] for s in setups}
    for r in range(args.rounds):
        for name in setups if r % 2 == 0 else setups[::-1]:
            ranks = launch(fit_worker, 2, name, 1, cfg, init_group=False, timeout=600)
            steps = [max(r["times"][k] for r in ranks) for k in range(len(ranks[0]["times"]))]
            fits[name].append(statistics.median(steps))
    step = {s: min(v) for s, v in fits.items()}
    ratios = {s: step[s] / step["replicated"] for s in setups}
    vs_mps = step["shard_parameters"] / step["ModelParallelStrategy"]
    bounds = {(m["dp"], m["pp"]): total / (m["dp"] * m["pp"]) + layer_bytes for m in memory}
    met = {
        "memory": all(
            m["total"] <= bounds[(m["dp"], m["pp"])] for m in memory if m["setup"] == "shard_parameters"
        ),
        "vs_model_parallel_strategy": vs_mps <= GOAL_RATIO,
    }
    if args.json:
        emit_json(
            {
                "benchmark": "fully_sharded",
                "config": cfg,
                "one_device_total_bytes": total,
                "one_layer_bytes": layer_bytes,
                "memory_bytes_per_rank": memory,
                "step_ms": {s: v * 1e3 for s, v in step.items()},
                "per_fit_median_ms": {s: [x * 1e3 for x in v] for s, v in fits.items()},
                "ratio_to_replicated": ratios,
                "shard_parameters_vs_model_parallel_strategy": vs_mps,
                "targets_met": met,
            }
        )
        return
    mib = 1024 * 1024
    print(f"{layers} x Linear({width}) + ReLU, Adam, global batch {args.batch}, gloo, one thread per rank")
    print(
        f"one device holds {total / mib:.2f} MiB (parameters, gradients, Adam state); "
        f"one layer {layer_bytes / mib:.2f} MiB"
    )
    print_table(
        ["set-up", "dp", "pp", "params MiB", "grads MiB", "state MiB", "total MiB", "bound MiB"],
        [
            [m["setup"], m["dp"], m["pp"], m["parameters"] / mib, m["gradients"] / mib,
             m["optimizer_state"] / mib, m["total"] / mib,
             bounds[(m["dp"], m["pp"])] / mib if m["setup"] == "shard_parameters" else "-"]
            for m in memory
        ],
    )  # fmt: skip
    print(f"shard_parameters within 1/(dp x pp) + one layer: {'met' if met['memory'] else 'MISSED'}")
    print_table(
        ["set-up (dp=2)", "step ms (best fit)", "per-fit medians ms", "ratio to replicated"],
        [[s, step[s] * 1e3, " ".join(f"{x * 1e3:.2f}" for x in fits[s]), ratios[s]] for s in setups],
    )
    print(
        f"shard_parameters / ModelParallelStrategy = {vs_mps:.3f} (goal <= {GOAL_RATIO}: "
        f"{'met' if met['vs_model_parallel_strategy'] else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
