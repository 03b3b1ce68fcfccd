"""Start N real processes (gloo on CPU), run a function in each and return what each returned.

The benchmarks' own launcher (they must not depend on the tests): a free port per call, one
intra-op thread per process (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), results passed
back through files, and a deadline after which every child is killed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple[Any, ...],
    init_group: bool = True,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        if init_group:  # a Lightning Trainer in ``fn`` initialises the group itself
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(*args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, init_group: bool = True
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, by rank
    (``init_group=False``: ``fn`` initialises the process group, e.g. through a Trainer)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, out_dir, args, init_group), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.join(timeout=5)
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, errors = [], []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pt"
            if not path.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed after a hang?)")
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"--- rank {r} ---\n{payload['error']}")
        if errors:
            raise RuntimeError("Benchmark run failed:\n" + "\n".join(errors))
        return results


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPUs' time that was busy over the next ``seconds`` (Linux ``/proc/stat``)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return fields[3] + fields[4], sum(fields)

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def warn_if_busy(threshold: float = 0.2) -> None:
    """Warn on stderr when something else keeps the machine busy: timings would be unreliable."""
    try:
        busy = busy_fraction()
    except OSError:
        return
    if busy > threshold:
        print(
            f"warning: the machine is {busy:.0%} busy before the benchmark starts; timings will be noisy",
            file=sys.stderr,
        )


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def emit_json(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=None, sort_keys=True))
