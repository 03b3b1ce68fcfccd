"""Run a function in N real processes (gloo on CPU) and collect what each returns.

Every test that needs several ranks goes through :func:`run_distributed`: a free port per call,
one intra-op thread per process (the CI machine has two cores), and a hard deadline after which
every child is killed and the test fails with the ranks that were still alive, so a hang costs
seconds, not the CI limit. A child's exception is re-raised in the parent with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
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
    args: tuple,
    pg_timeout: float,
    init_group: bool,
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
        if init_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
            )
        result = fn(*args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    init_group: bool = True,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, by rank.

    With ``init_group=False`` the children only get the torchrun-style environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``) and ``fn`` initialises the group itself, as a
    Lightning ``Trainer`` does.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, port, out_dir, args, pg_timeout, init_group),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = False
        while time.monotonic() < deadline:
            if all(p.exitcode is not None for p in procs):
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                failed = True
                # Give the others a moment to fail on their own (their error is often the clue).
                for p in procs:
                    p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
                break
            time.sleep(0.05)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world_size):
            path = Path(out_dir) / f"rank{r}.pt"
            if not path.exists():
                results.append(None)
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"--- rank {r} ---\n{payload['error']}")
                results.append(None)
        if errors:
            raise RuntimeError("Distributed run failed:\n" + "\n".join(errors))
        if alive and not failed:
            raise TimeoutError(f"Ranks {alive} were still running after {timeout:.0f}s (hang?); killed.")
        if alive or any(p.exitcode != 0 for p in procs):
            codes = {r: p.exitcode for r, p in enumerate(procs)}
            raise RuntimeError(
                f"Distributed run failed: exit codes {codes}, still alive at the end: {alive}."
            )
        return results
