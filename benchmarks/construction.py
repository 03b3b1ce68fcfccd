"""What each rank holds when it builds the model: eager construction against meta construction.

A stack of ``--blocks`` blocks of two ``Linear(width, width)`` (default 32 blocks of width 2048:
1.07 GB of fp32 weights) trains one step with SGD and momentum under ``pipe_tp`` at pp = 1, 2, 4
and pp=2 x tp=2, built either

* ``eager``: in ``__init__``, so every rank builds the whole model (what pipe_tp did before), or
* ``meta``: in ``configure_model()``, so the parameters are created on the meta device and each
  rank materialises only its own stage (and tensor slice).

Per run the table gives, for the rank that holds the most: the parameter bytes with storage over
the model's (goal: at most 1/(pp x tp) plus one layer), the peak RSS above the process's RSS before
the model was built, the budget ``1.3 x (own parameters + gradients + optimizer state) + the
largest layer`` and the peak over that budget (goal <= 1), and the setup time (building the model
plus ``Trainer.fit`` up to the first step).

``--headline``: a per-process memory limit (``RLIMIT_DATA``, the process's private writable
memory) set below the model's weights, ``--limit-gb`` above what the process had mapped before
building; ``strategy="auto"`` on one process must fail for lack of memory while pp=4 (meta) trains
with every process under the limit.

Run: ``python benchmarks/construction.py`` (table) or ``--json``; ``--headline`` adds the limited
runs. Each run is a fresh set of processes, one after the other.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import time
import traceback
import warnings
from typing import Any

import lightning as L
import torch
from _launch import emit_json, launch, print_table, warn_if_busy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeTPStrategy

LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2)]


class Stack(L.LightningModule):
    """``blocks`` blocks of ``Linear -> GELU -> Linear``; built in ``__init__`` when ``eager``."""

    def __init__(self, width: int, blocks: int, eager: bool, momentum: float = 0.9) -> None:
        super().__init__()
        self.width, self.blocks, self.momentum = width, blocks, momentum
        self.layers: nn.Sequential | None = None
        if eager:
            self.configure_model()

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        w = self.width
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(w, w), nn.GELU(), nn.Linear(w, w)) for _ in range(self.blocks)]
        )

    def configure_pipeline(self) -> list[nn.Module]:
        assert self.layers is not None
        return list(self.layers)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"layers.*.0": "colwise", "layers.*.2": "rowwise"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=self.momentum)


class _FirstStep(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at = time.perf_counter()


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def worker(
    how: str, pp: int, tp: int, width: int, blocks: int, limit: int, momentum: float = 0.9
) -> dict[str, Any]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8)
    baseline = _rss_now()
    if limit:
        resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + limit, resource.RLIM_INFINITY))
    start = time.perf_counter()
    first = _FirstStep()
    try:
        model = Stack(width, blocks, eager=how != "meta", momentum=momentum)
        strategy: Any = "auto"
        if how != "auto":
            strategy = PipeTPStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=pp * tp, max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[first],
        )  # fmt: skip
        trainer.fit(model, data)
    except (RuntimeError, MemoryError) as err:  # the limited run of strategy="auto"
        if not limit:
            raise
        where = traceback.extract_tb(err.__traceback__)[-3:]
        at = "; ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in where)
        return {"failed": f"{type(err).__name__}: {str(err).splitlines()[0][-60:]} at {at}"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = list(model.parameters())
    own = [p for p in params if not p.is_meta and p.grad is not None]
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
    largest = (width * width + width) * 4
    whole = blocks * 2 * largest  # the unsharded model (other stages' layers stay unsharded, meta)
    budget = 1.3 * (_bytes(own) + _bytes(p.grad for p in own) + _bytes(state)) + largest
    return {
        "held_fraction": _bytes(params) / whole,
        "peak_rss_above_start": peak - baseline,
        "budget": budget,
        "peak_over_budget": (peak - baseline) / budget,
        "setup_s": first.at - start,
        "model_bytes": whole,
    }


def _worst(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank that holds the most (then: peaks highest)."""
    return max(results, key=lambda r: (r["held_fraction"], r["peak_rss_above_start"]))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--headline", action="store_true")
    parser.add_argument("--headline-only", action="store_true")
    parser.add_argument("--headline-blocks", type=int, default=64)
    parser.add_argument("--limit-gb", type=float, default=1.5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    # glibc raises its mmap threshold after the first large free, after which freed blocks stay in
    # the heap: RSS and the data size would then count memory that is no longer used (8 x 16 MB
    # created and freed left VmData 117 MB larger). Pinned, large blocks are unmapped when freed;
    # the children inherit it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    out: dict[str, Any] = {"runs": {}}
    for pp, tp in [] if args.headline_only else LAYOUTS:
        for how in ("eager", "meta"):
            results = launch(worker, pp * tp, how, pp, tp, args.width, args.blocks, 0, timeout=900)
            out["runs"][f"{how}/pp{pp}xtp{tp}"] = {
                "worst": _worst(results),
                "setup_s_max": max(r["setup_s"] for r in results),
            }
    if args.headline or args.headline_only:
        limit = int(args.limit_gb * 2**30)
        # Plain SGD (no state): at pp=4 each rank holds a quarter of the weights and their gradients.
        shape = (args.width, args.headline_blocks, limit, 0.0)
        auto = launch(worker, 1, "auto", 1, 1, *shape, timeout=900)[0]
        pp4 = launch(worker, 4, "meta", 4, 1, *shape, timeout=900)
        out["headline"] = {"limit_bytes": limit, "auto": auto, "pp4_meta": pp4}
    if args.json:
        emit_json(out)
        return
    model_gb = (args.width**2 + args.width) * 8 * args.blocks / 1e9
    shape = f"{args.blocks} blocks of 2 x Linear({args.width})"
    print(f"{shape}: {model_gb:.2f} GB of fp32 weights, SGD with momentum\n")
    rows = []
    for name, run in out["runs"].items():
        w = run["worst"]
        rows.append([
            name, w["held_fraction"], w["peak_rss_above_start"] / 1e6, w["budget"] / 1e6,
            w["peak_over_budget"], run["setup_s_max"],
        ])  # fmt: skip
    print_table(
        ["construction/layout", "held / model", "peak RSS above start (MB)", "budget (MB)",
         "peak / budget", "setup (s)"],
        rows,
    )  # fmt: skip
    if "headline" in out:
        h = out["headline"]
        gb, whole = h["limit_bytes"] / 1e9, (args.width**2 + args.width) * 8 * args.headline_blocks / 1e9
        print(f"\n{args.headline_blocks} blocks ({whole:.2f} GB of weights), plain SGD, RLIMIT_DATA")
        print(f"{gb:.2f} GB above each process's start:")
        print(f"  strategy='auto', 1 process: {h['auto'].get('failed', 'trained')}")
        for rank, r in enumerate(h["pp4_meta"]):
            if "failed" in r:
                print(f"  pp=4, meta construction, rank {rank}: {r['failed']}")
            else:
                peak = r["peak_rss_above_start"] / 1e6
                print(f"  pp=4, meta construction, rank {rank}: trained, peak RSS {peak:.0f} MB above start")


if __name__ == "__main__":
    main()
