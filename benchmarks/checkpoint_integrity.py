"""What checking a checkpoint's bytes costs: saving and reading a ~100 MB sharded checkpoint with
the per-tensor CRC32s (and zip CRC32s) and with every check switched off.

One process writes a checkpoint directory of a stack of ``Linear(d, d)`` layers and their SGD
momentum buffers (``--width 1024 --layers 12``: 12.6 M parameters, 101 MB of weights and optimizer
state) through the same writer a pipe_tp rank uses, then reads it back whole with
``consolidate_checkpoint`` (what resuming reads, plus the copies consolidation makes). Each
measurement alternates the checked and the unchecked variant, ``--repeats`` times, and the table
gives the medians and the overhead. A third row reads the same checkpoint as one written before
the checksums (no CRC32 in its metadata), whose shard file is then checked against its zip
entries' CRC32 instead. The file is in the page cache (just written): the figures are the CPU cost
of the checks, not the disk's.

Run: ``python benchmarks/checkpoint_integrity.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _launch import emit_json, median, print_table
from torch import nn

from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint import reader as reader_module
from lightning_pipe.checkpoint import writer as writer_module
from lightning_pipe.checkpoint.metadata import CheckpointMetadata, part_file_name
from lightning_pipe.checkpoint.state import model_entries, model_part, optimizer_entries, optimizer_part
from lightning_pipe.checkpoint.writer import PartFile, write_checkpoint_directory
from lightning_pipe.partition.model import PipelinePartition

LAYOUT = {"data_parallel_size": 1, "pipeline_parallel_size": 1, "tensor_parallel_size": 1}


@contextmanager
def unchecked() -> Iterator[None]:
    """Every checksum computation and comparison switched off (what the code did before them)."""
    saved = (
        writer_module.PartFile.with_checksums,
        reader_module.CheckpointDirectory._check_zip,
        reader_module.CheckpointDirectory._check_bytes,
    )
    writer_module.PartFile.with_checksums = lambda self: self  # type: ignore[method-assign]
    reader_module.CheckpointDirectory._check_zip = lambda *a, **k: None  # type: ignore[method-assign]
    reader_module.CheckpointDirectory._check_bytes = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        (
            writer_module.PartFile.with_checksums,
            reader_module.CheckpointDirectory._check_zip,
            reader_module.CheckpointDirectory._check_bytes,
        ) = saved  # type: ignore[method-assign]


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return module, optimizer


def save(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    plan = PipelinePartition(layer_names=("no_layer",), balance=(1,), parameter_counts=(0,))
    file = part_file_name(0, 0)
    model = model_part(module, plan, 0, 0)
    opt = optimizer_part(optimizer, module, plan, 0, 0)
    shard = PartFile(
        file,
        {"model": model, "optimizers": [opt["state"]]},
        model_entries(model, module, 1, 0, file),
        [optimizer_entries(opt["state"], module, 1, 0, file)],
    )
    state = {"optimizer_states": [{k: v for k, v in opt.items() if k != "state"}]}
    header = CheckpointMetadata(layout=dict(LAYOUT), layer_names=["no_layer"], balance=[1])
    write_checkpoint_directory(path, shard, state, header)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    module, optimizer = build(args.width, args.layers)
    root = Path(tempfile.mkdtemp())
    checked, legacy = root / "checked.ckpt", root / "legacy.ckpt"
    times: dict[str, list[float]] = {k: [] for k in ("save", "save0", "load", "load0", "legacy")}
    try:
        for _ in range(args.repeats):
            times["save"].append(timed(lambda: save(checked, module, optimizer)))
            with unchecked():
                times["save0"].append(timed(lambda: save(root / "plain.ckpt", module, optimizer)))
            times["load"].append(timed(lambda: consolidate_checkpoint(checked)))
            with unchecked():
                times["load0"].append(timed(lambda: consolidate_checkpoint(checked)))
            shutil.rmtree(legacy, ignore_errors=True)
            shutil.copytree(root / "plain.ckpt", legacy)  # no CRC32 in its metadata
            times["legacy"].append(timed(lambda: consolidate_checkpoint(legacy)))
        size = sum(f.stat().st_size for f in checked.iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    m = {k: median(v) for k, v in times.items()}
    result = {
        "checkpoint_mb": size / 1e6,
        "save_s": m["save"],
        "save_unchecked_s": m["save0"],
        "save_overhead": m["save"] / m["save0"] - 1,
        "load_s": m["load"],
        "load_unchecked_s": m["load0"],
        "load_overhead": m["load"] / m["load0"] - 1,
        "load_without_checksums_s": m["legacy"],
        "load_without_checksums_overhead": m["legacy"] / m["load0"] - 1,
    }
    if args.json:
        emit_json(result)
        return
    print(f"checkpoint: {size / 1e6:.1f} MB (weights + SGD momentum), median of {args.repeats}")
    print_table(
        ["", "checked (s)", "unchecked (s)", "overhead"],
        [
            ["save", f"{m['save']:.3f}", f"{m['save0']:.3f}", f"{result['save_overhead']:+.0%}"],
            ["read whole (consolidate)", f"{m['load']:.3f}", f"{m['load0']:.3f}",
             f"{result['load_overhead']:+.0%}"],
            ["read whole, no checksums (zip CRC32)", f"{m['legacy']:.3f}", f"{m['load0']:.3f}",
             f"{result['load_without_checksums_overhead']:+.0%}"],
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
