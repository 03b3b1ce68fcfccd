"""End to end, the user's view: one decoder-only transformer trained on 4 processes by each way a
Lightning user could split it, through ``Trainer.fit`` (and torch's own pipelining, by hand).

The model is the example GPT (``examples/gpt/gpt_model.py``: ``CharGPT``, ``--layers`` blocks of
width ``--d-model``, sequences of ``--seq`` characters of the Python standard library's source,
AdamW with the example's warm-up). Every set-up trains the same global batches (Lightning's
shuffled ``DistributedSampler``, which the hand-written loop uses too) from the same initial
weights (each module's ``reset_parameters()`` from a stream seeded by its name, as ``pipe_tp``
builds them: the other set-ups build the model on the meta device and call the same initialiser),
so that the first step's loss is the same number everywhere; it is printed per set-up as the check
that the comparison is of one training. Pipelines split the batch into ``2 x pp`` micro-batches
(1F1B).

Set-ups (``--setups``; all on 4 gloo ranks, one intra-op thread each):

* ``ddp``: ``strategy="ddp"``, the model replicated, 4 replicas.
* ``fsdp``: ``strategy=FSDPStrategy(auto_wrap_policy={Block})``, Lightning's FSDP (FSDP1), one
  unit per transformer block, 4 shards.
* ``model_parallel``: ``ModelParallelStrategy``, tp=2 x dp=2: each block's attention and MLP split
  with ``parallelize_module`` (Colwise/Rowwise), then FSDP2 (``fully_shard``) per block over the
  data-parallel axis, in the module's ``configure_model``, as Lightning's docs write it.
* ``pipe_tp_pp4``, ``pipe_tp_pp2_dp2``, ``pipe_tp_pp2_tp2``: ``PipeTPStrategy`` at those layouts
  (``tensor_parallel_plan`` of the example: vocab-parallel embedding and loss).
* ``torch_pp4``, ``torch_pp2_ddp2``: ``torch.distributed.pipelining`` (``PipelineStage`` +
  ``Schedule1F1B``) driving the same stages (the same layers, split by the same balance as
  ``pipe_tp``), with a hand-written step loop; at pp=2 each stage is wrapped in
  ``DistributedDataParallel`` over its 2 replicas (torch's stage runs the non-last micro-batches'
  backward under ``no_sync``).

Columns: tokens/s over the timed steps (``--steps`` consecutive steps after ``--warmup``, no barrier
between them; the slowest rank's time from the start of the first timed step to the end of the
last), its ratio to DDP's, peak RSS per rank (the largest over the ranks; every set-up runs in fresh
processes, since a peak never goes down) and its growth over the process's RSS before the model is
built, and the bytes of parameters + gradients + optimizer state a rank holds after a step (the
largest rank's; deterministic, the most trustworthy column).

Run: ``python benchmarks/end_to_end.py`` (table, about 5 minutes on 2 cores) or ``--json``;
``--quick`` is a smoke run of a tiny model, 1 + 2 steps per set-up (its figures mean nothing; each
set-up still starts 4 fresh processes, 10-15 s here).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from itertools import chain
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _launch import emit_json, launch, print_table, warn_if_busy
from fully_sharded import _held_bytes as held_bytes  # the same accounting as fully_sharded.py's table
from fully_sharded import _local_bytes as local_bytes
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.construction.materialize import materialize
from lightning_pipe.partition.balance import compute_balance, split_layers
from lightning_pipe.tensor_parallel import cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from char_data import encode, stdlib_text
from gpt_model import Block, CharGPT

SEED = 0
WORLD = 4
LOSS_TOLERANCE = 1e-4  # relative: the same numbers summed in other orders


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way to train the model on the 4 processes."""

    label: str
    kind: str  # "ddp", "fsdp", "model_parallel", "pipe_tp" or "torch"
    pp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return WORLD // (self.pp * self.tp)


SETUPS = {
    "ddp": Setup('strategy="ddp"', "ddp"),
    "fsdp": Setup('strategy="fsdp"', "fsdp"),
    "model_parallel": Setup("ModelParallelStrategy tp=2 x dp=2", "model_parallel", tp=2),
    "pipe_tp_pp4": Setup("pipe_tp pp=4", "pipe_tp", pp=4),
    "pipe_tp_pp2_dp2": Setup("pipe_tp pp=2 x dp=2", "pipe_tp", pp=2),
    "pipe_tp_pp2_tp2": Setup("pipe_tp pp=2 x tp=2", "pipe_tp", pp=2, tp=2),
    "torch_pp4": Setup("torch 1F1B pp=4", "torch", pp=4),
    "torch_pp2_ddp2": Setup("torch 1F1B pp=2 x DDP 2", "torch", pp=2),
}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _build_like_pipe_tp(model: CharGPT) -> None:
    """Build ``model``'s layers with the initial values ``pipe_tp`` gives them: on the meta device,
    then each module initialised by the package's own initialiser (seeded by the run's seed and the
    module's name), so that every set-up starts from the same weights. The device context is
    explicit because strategies call ``configure_model`` under their own (``torch.device("meta")``
    for empty init)."""
    with torch.device("meta"):
        CharGPT.configure_model(model)
    with torch.device("cpu"):
        materialize(model, torch.device("cpu"), SEED, set())


class BenchGPT(CharGPT):
    """The example GPT as the benchmark trains it: no logging (the same in every set-up), no
    validation, and the first step's loss kept for the check that all set-ups train the same."""

    def __init__(self, own_init: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.own_init = own_init
        self.first_losses: list[float] = []

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        if self.own_init:
            _build_like_pipe_tp(self)
        else:  # pipe_tp: built on meta, each rank materialises its own stage with the same values
            super().configure_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        loss = cross_entropy(self(ids), targets)
        if self.global_step == 0:
            self.first_losses.append(float(loss.detach()))
        return loss


class ModelParallelGPT(BenchGPT):
    """The same model written for ``ModelParallelStrategy``: tensor parallelism on each block's
    attention and MLP with ``parallelize_module``, then FSDP2 over the data-parallel axis."""

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        _build_like_pipe_tp(self)
        assert self.layers is not None
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
        for block in self.layers[1:-1]:
            parallelize_module(block, tp_mesh, plan)
            # The attention reads its local head count from the projection's output size, which
            # parallelize_module leaves at the full width (pipe_tp's column layer is the slice).
            block.attn.qkv.out_features //= tp_mesh.size()
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)


class _Measure(L.Callback):
    """Timestamps of consecutive steps (no barrier: the loop runs as a user's would) and, after the
    last step, the bytes this rank holds."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.starts: list[float] = []
        self.end = 0.0
        self.bytes: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.last:
            self.end = time.perf_counter()
            self.bytes = held_bytes(trainer, module)


def _data(cfg: dict[str, Any]) -> TensorDataset:
    """``batch x (warmup + steps)`` windows of the standard library's source: input, next char."""
    n, seq = cfg["batch"] * (cfg["warmup"] + cfg["steps"]), cfg["seq"]
    ids = encode(stdlib_text(n * (seq + 1)))
    windows = ids[: n * (seq + 1)].view(n, seq + 1)
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def _model_args(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "d_model": cfg["d_model"],
        "n_heads": cfg["heads"],
        "n_layers": cfg["layers"],
        "max_len": cfg["seq"],
    }


class _CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on the CPU. ``Trainer`` refuses ``FSDPStrategy`` with a CPU
    accelerator (by an exact type check, which a subclass passes), and torch's FSDP refuses a CPU
    module unless ``device_id`` names the CPU, which Lightning leaves ``None`` there: the wrapping is
    Lightning's own with that one argument, so this machine measures the same code."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def _strategy(setup: Setup) -> Any:
    if setup.kind == "ddp":
        return "ddp"
    if setup.kind == "fsdp":
        return _CPUFSDPStrategy(auto_wrap_policy={Block})
    if setup.kind == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=setup.dp, tensor_parallel_size=setup.tp)
    return PipeTPStrategy(
        pipeline_parallel_size=setup.pp,
        tensor_parallel_size=setup.tp,
        num_microbatches=2 * setup.pp,
        schedule="1f1b",
    )


def lightning_worker(setup: Setup, cfg: dict[str, Any]) -> dict[str, Any]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    start_rss = _rss_now()
    L.seed_everything(SEED, verbose=False)
    cls = ModelParallelGPT if setup.kind == "model_parallel" else BenchGPT
    model = cls(own_init=setup.kind != "pipe_tp", **_model_args(cfg))
    total = cfg["warmup"] + cfg["steps"]
    measure = _Measure(last=total)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            strategy=_strategy(setup), accelerator="cpu", devices=WORLD, max_steps=total,
            callbacks=[measure], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
        )  # fmt: skip
        loader = DataLoader(_data(cfg), batch_size=cfg["batch"] // setup.dp, shuffle=False)
        trainer.fit(model, loader)
    return {
        "seconds": measure.end - measure.starts[cfg["warmup"]],
        "first_losses": model.first_losses,
        "bytes": measure.bytes,
        "peak_rss": _peak_rss(),
        "start_rss": start_rss,
    }


def torch_worker(setup: Setup, cfg: dict[str, Any]) -> dict[str, Any]:
    """torch's pipelining over the same stages, outside Lightning: the step loop a user writes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore")
    start_rss = _rss_now()
    L.seed_everything(SEED, verbose=False)
    pp, dp = setup.pp, setup.dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    stage, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = stage == 0, stage == pp - 1
    model = BenchGPT(own_init=True, **_model_args(cfg))
    with torch.device("meta"):
        CharGPT.configure_model(model)
    layers = model.configure_pipeline()
    own = split_layers(layers, compute_balance(layers, pp))[stage]  # pipe_tp's default balance
    mine = {id(t) for layer in own for t in chain(layer.parameters(), layer.buffers())}
    with torch.device("cpu"):  # only this stage's tensors get storage, with pipe_tp's values
        others = {id(t) for t in chain(model.parameters(), model.buffers()) if id(t) not in mine}
        materialize(model, torch.device("cpu"), SEED, others)
    module: nn.Module = nn.Sequential(*own)
    params = list(module.parameters())
    if dp > 1:
        module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    pipe_stage = PipelineStage(module, stage, pp, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    schedule = Schedule1F1B(pipe_stage, n_microbatches=2 * pp, loss_fn=loss_fn)
    hp = model.hparams
    optimizer = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
    # The sampler Lightning puts in a training dataloader (shuffled, seeded by the run's seed,
    # sharded by the replica), so that every step trains the same global batch as the others.
    sampler = DistributedSampler(_data(cfg), num_replicas=dp, rank=replica, shuffle=True, seed=SEED)
    loader = DataLoader(sampler.dataset, batch_size=cfg["batch"] // dp, sampler=sampler)
    first_losses: list[float] = []
    start = 0.0
    for step, (x, y) in enumerate(loader):
        if step == cfg["warmup"]:
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if first:
            schedule.step(x)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            if step == 0:
                first_losses = [float(v.detach()) for v in losses]
        else:
            schedule.step()
        optimizer.step()
        warmup.step()
    seconds = time.perf_counter() - start
    state = sum(
        local_bytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )
    held = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params),
        "optimizer_state": state,
    }
    return {
        "seconds": seconds,
        "first_losses": first_losses,
        "bytes": held,
        "peak_rss": _peak_rss(),
        "start_rss": start_rss,
    }


def run_setup(setup: Setup, cfg: dict[str, Any]) -> dict[str, Any]:
    """One set-up in 4 fresh processes: its tokens/s, first-step loss, memory per rank."""
    if setup.kind == "torch":
        ranks = launch(torch_worker, WORLD, setup, cfg, timeout=cfg["timeout"])
    else:
        ranks = launch(lightning_worker, WORLD, setup, cfg, init_group=False, timeout=cfg["timeout"])
    seconds = max(r["seconds"] for r in ranks)
    losses = [v for r in ranks for v in r["first_losses"]]  # equal-sized pieces of the global batch
    held = max((r["bytes"] for r in ranks), key=lambda b: sum(b.values()))
    return {
        "tokens_per_s": cfg["batch"] * cfg["seq"] * cfg["steps"] / seconds,
        "step_ms": seconds / cfg["steps"] * 1e3,
        "first_loss": sum(losses) / len(losses),
        "first_losses_per_rank": [r["first_losses"] for r in ranks],
        "peak_rss_bytes": max(r["peak_rss"] for r in ranks),
        "rss_growth_bytes": max(r["peak_rss"] - r["start_rss"] for r in ranks),
        "held_bytes": {**held, "total": sum(held.values())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps, consecutive")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), every set-up")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per set-up before its ranks are killed"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model for 1 + 2 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.heads, args.seq, args.batch, args.warmup, args.steps = 32, 2, 32, 8, 1, 2
    warn_if_busy()
    cfg = vars(args)
    # glibc's mmap threshold adapts upwards once a large block is freed, after which freed memory
    # stays in the heap and RSS stops following live memory; pin it (children inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    results = {name: run_setup(SETUPS[name], cfg) for name in args.setups}
    base = results.get("ddp")
    for r in results.values():
        r["ratio_to_ddp"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    reference = next(iter(results.values()))["first_loss"]
    agree = all(abs(r["first_loss"] - reference) <= LOSS_TOLERANCE * abs(reference) for r in results.values())
    if args.json:
        emit_json({"benchmark": "end_to_end", "config": cfg, "results": results, "first_losses_agree": agree})
        return
    mib = 2**20
    print(
        f"CharGPT: {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, sequence {args.seq}, "
        f"global batch {args.batch} ({args.batch * args.seq} tokens), AdamW; {WORLD} gloo ranks, one thread "
        f"each; {args.steps} timed steps after {args.warmup}; pipelines: 1F1B, 2 x pp micro-batches"
    )
    print_table(
        ["set-up", "tokens/s", "vs DDP", "step ms", "peak RSS MiB", "RSS growth MiB", "held MiB",
         "first loss"],
        [
            [SETUPS[n].label, round(r["tokens_per_s"]), r["ratio_to_ddp"] if base else "-", r["step_ms"],
             r["peak_rss_bytes"] / mib, r["rss_growth_bytes"] / mib, r["held_bytes"]["total"] / mib,
             f"{r['first_loss']:.6f}"]
            for n, r in results.items()
        ],
    )  # fmt: skip
    print(f"first-step losses agree within {LOSS_TOLERANCE:g} (relative): {'yes' if agree else 'NO'}")


if __name__ == "__main__":
    main()
