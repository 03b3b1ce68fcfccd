"""Run a function in N real processes (gloo on CPU) and collect what each returns.

Every test that needs several ranks goes through :func:`run_distributed`: a free port per call,
one intra-op thread per process (the CI machine has two cores), and a hard deadline after which
every child is killed and the test fails with the ranks that were still alive, so a hang costs
seconds, not the CI limit. A child's exception is re-raised in the parent with its traceback.

Such a test must carry ``@pytest.mark.distributed`` (``pytest -m "not distributed"`` is the fast,
single-process loop): ``tests/conftest.py`` tells this module which test runs and whether it is
marked (:func:`running_test`), and starting processes from an unmarked test is an error.

Ranks are forked from a ``forkserver`` that imported torch, Lightning, transformers and this
package once per pytest session (:data:`PRELOAD`), instead of each ``spawn``-ed rank importing
them again: importing Lightning alone costs about 8 s of CPU, which was most of a 2-rank launch
on the two-core CI machine. Each rank is still a fresh process with no process group and the
parent's environment at launch time, as ``spawn`` gave it (:func:`_child` installs it, since a
forked rank would otherwise see the server's). ``TESTS_START_METHOD=spawn`` starts every rank
the old way (to compare, or to rule the fork server out when a launch misbehaves).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist


class UnmarkedTestError(RuntimeError):
    """A test without ``@pytest.mark.distributed`` tried to start processes."""


_test: tuple[str, bool] | None = None
"""The pytest test now running (its node id) and whether it is marked ``distributed``; ``None``
outside pytest (a script may start ranks freely)."""


@contextmanager
def running_test(nodeid: str, marked: bool) -> Iterator[None]:
    """While the test ``nodeid`` runs (its fixtures' setup and teardown included), let it start
    processes only if it is ``marked`` distributed."""
    global _test
    previous, _test = _test, (nodeid, marked)
    try:
        yield
    finally:
        _test = previous


def _check_marked(world_size: int) -> None:
    if _test is not None and not _test[1]:
        processes = f"{world_size} process{'es' if world_size != 1 else ''}"
        raise UnmarkedTestError(
            f"{_test[0]} starts {processes}: mark it @pytest.mark.distributed (or its module: "
            "`pytestmark = pytest.mark.distributed`), so that `pytest -m 'not distributed'` stays the "
            "fast single-process loop."
        )


PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.nn.functional",
    "torch.utils.data",
    "lightning",
    "lightning.pytorch",
    "torchmetrics",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    *(  # tests/hf_families.py's
        f"transformers.models.{family}.modeling_{family}"
        for family in ("mistral", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "granite", "cohere2")
    ),
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.auto",
    "safetensors.torch",
    "peft",
    "lightning_pipe",
    "lightning_pipe.strategy",
    "lightning_pipe.huggingface",
    "tests.distributed",
    "tests.models",
    "tests.lightning_models",
    "tests.trainers",
    "tests.gpt_models",
    "tests.hf_models",
)
"""What the fork server imports once, so that no rank imports it again (a module that is missing
is skipped by the server; a rank imports whatever else its function needs)."""

_context: mp.context.BaseContext | None = None


def _rank_context() -> mp.context.BaseContext:
    """The ``forkserver`` context, its server started (once) with :data:`PRELOAD` imported.

    The server starts with one OpenMP thread: a process forked after OpenMP has started its
    thread pool can hang in its first parallel region (GNU libgomp is not fork-safe), and a pool
    of one thread starts no threads at all. The ranks set their own thread count anyway.
    """
    global _context
    if os.environ.get("TESTS_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    if _context is None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        with mock.patch.dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            multiprocessing.forkserver.ensure_running()
        _context = context
    return _context


class _ParentStream:
    """The parent's file descriptor ``fd`` (its stdout or stderr), handed to a rank at launch.

    A forked rank's stdout and stderr are the fork server's, which are whatever they were when the
    server started (the capture file of the test that was running then); a rank writes to its
    parent's streams as they are now, as a spawned rank did, so that pytest's capture (``capfd``,
    a failing test's output) sees what the ranks print. The descriptor travels with the launch
    (``multiprocessing.reduction.DupFd``), which works for ``spawn`` as for ``forkserver``.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _received_fd(handle: Any) -> int:
    return int(handle.detach())


PORTS_BELOW_EPHEMERAL = 8192
"""How many ports under the kernel's ephemeral range :func:`free_port` hands out (split between
the pytest-xdist workers)."""

_next_offset: int | None = None
"""Where in this process's slice :func:`free_port` looks next (``None``: not called yet)."""


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or ``None`` where it can't be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a launch's rendezvous store, free now and not about to be taken by another process.

    A port the kernel picks (``bind(("", 0))``) is ephemeral: between this call and the moment the
    launch's rank 0 binds it (seconds later: its process forks, imports, builds a model), the kernel
    may give the same number to any new connection, gloo's own among them, of the other pytest-xdist
    worker's launches (``EADDRINUSE`` from ``TCPStore``; seen once in a whole run). So the port comes
    from under the ephemeral range, where the kernel never assigns one itself, from a slice of its
    own for each xdist worker, taken in turn (a port is not reused until the slice wraps) and
    checked free now.
    """
    low = _ephemeral_low()
    if low is None or low <= 1024 + PORTS_BELOW_EPHEMERAL:  # an unusual range: let the kernel pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = PORTS_BELOW_EPHEMERAL // workers
    first = low - PORTS_BELOW_EPHEMERAL + (index % workers) * size
    # Start where this process's pid puts it: the worker's subprocesses (a script launching ranks
    # itself) pick ports too, and should not all begin at the same one.
    global _next_offset
    offset = _next_offset if _next_offset is not None else os.getpid() % size
    for step in range(size):
        port = first + (offset + step) % size
        if _bindable(port):
            _next_offset = (offset + step + 1) % size
            return port
    raise RuntimeError(f"no free port in {first}-{first + size - 1} (pytest-xdist worker {worker})")


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple,
    pg_timeout: float,
    init_group: bool,
    environ: dict[str, str],
    streams: tuple[int, int],
) -> None:
    # The parent's streams and environment at launch (a forked rank starts with the fork server's).
    for fd, target in zip(streams, (1, 2), strict=True):
        if fd != target:  # a spawned rank inherits them under their own numbers
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
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
        # Exit at once, as a crashed job does: a graceful destroy_process_group could wait on
        # peers that are themselves still waiting, which is not what these tests measure.
        os._exit(1)
    # Done: exit without tearing down the process groups either. Destroying them while a peer
    # process exits was seen to abort a rank after its work was saved ("terminate called without
    # an active exception", in about one full suite run of three); the kernel closes every
    # connection anyway, and what the test measures is already in ``out``.
    if rank == 0:
        # Rank 0 hosts the rendezvous store: leaving while a peer still talks to it (creating a
        # group, say) would end that peer with "Connection reset by peer". Wait (a while) until
        # every rank has written its outcome.
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and not all(
            (Path(out_dir) / f"rank{r}.pt").exists() for r in range(world_size)
        ):
            time.sleep(0.02)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class Outcome:
    """How one rank ended: its exit code, its result or its error text, and whether it was killed."""

    rank: int
    exitcode: int | None
    result: Any = None
    error: str | None = None
    killed: bool = False
    seconds: float = 0.0


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    timeout: float,
    pg_timeout: float,
    init_group: bool,
    grace: float,
) -> list[Outcome]:
    """Start the ranks, wait until all exit (or ``grace`` s after the first failure, or the
    deadline), kill what is left, and report every rank's outcome."""
    _check_marked(world_size)
    ctx = _rank_context()
    port = free_port()
    environ = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    streams = (_ParentStream(1), _ParentStream(2))
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, port, out_dir, args, pg_timeout, init_group, environ, streams),
                daemon=True,
            )
            for r in range(world_size)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        deadline = start + timeout
        ended: dict[int, float] = {}
        while time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in ended:
                    ended[r] = time.monotonic() - start
            if len(ended) == world_size:
                break
            failures = [p for p in procs if p.exitcode not in (None, 0)]
            if failures and time.monotonic() > start + min(ended.values()) + grace:
                break
            time.sleep(0.05)
        outcomes = []
        for r, p in enumerate(procs):
            killed = p.is_alive()
            if killed:
                p.kill()
            p.join()
            outcome = Outcome(r, None if killed else p.exitcode, killed=killed, seconds=ended.get(r, 0.0))
            path = Path(out_dir) / f"rank{r}.pt"
            if path.exists():
                payload = torch.load(path, weights_only=False)
                if payload["ok"]:
                    outcome.result = payload["result"]
                else:
                    outcome.error = payload["error"]
            outcomes.append(outcome)
        return outcomes


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
    Lightning ``Trainer`` does. Any failure raises, with every failed rank's traceback.
    """
    outcomes = _launch(fn, world_size, args, timeout, pg_timeout, init_group, grace=10.0)
    errors = [f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error]
    if errors:
        raise RuntimeError("Distributed run failed:\n" + "\n".join(errors))
    killed = [o.rank for o in outcomes if o.killed]
    if killed:
        raise TimeoutError(f"Ranks {killed} were still running after {timeout:.0f}s (hang?); killed.")
    if any(o.exitcode != 0 for o in outcomes):
        codes = {o.rank: o.exitcode for o in outcomes}
        raise RuntimeError(f"Distributed run failed: exit codes {codes}.")
    return [o.result for o in outcomes]


def run_distributed_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    init_group: bool = True,
) -> list[Outcome]:
    """Like :func:`run_distributed` for runs that are meant to fail: waits for every rank to end
    on its own (until ``timeout``), and returns each rank's outcome instead of raising."""
    return _launch(fn, world_size, args, timeout, pg_timeout, init_group, grace=timeout)


def script_main(path: str, argv: list[str], cwd: str) -> None:
    """Run ``path`` as ``python path *argv`` would run it, in ``cwd``, in this rank."""
    os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))  # as the interpreter puts a script's folder first
    runpy.run_path(path, run_name="__main__")


def run_script(
    path: str | Path, argv: list[str], world_size: int, cwd: str | Path, timeout: float = 300.0
) -> None:
    """Run a script on ``world_size`` ranks as ``torchrun --nproc-per-node world_size path *argv``
    would: each rank runs it as ``__main__`` with torchrun's ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``MASTER_*`` set (so a Lightning ``Trainer`` starts no processes of its own,
    and a script calling ``init_process_group()`` joins the others), but forked from the fork
    server instead of a fresh interpreter per rank, which costs each rank seconds of imports. Tests
    of the launchers themselves (torchrun, Lightning's) start those instead.
    """
    run_distributed(
        script_main, world_size, str(path), list(argv), str(cwd), init_group=False, timeout=timeout
    )
