"""SIGTERM to any rank ends every rank within seconds, whatever the exchange deadline (120 s here),
with a non-zero exit and one line naming the signal and the rank, and leaves no process behind:
with Lightning's own launcher (``python train.py``; rank 1 is rank 0's child) and with ranks
started by an external launcher (torchrun, SLURM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.distributed import free_port, run_distributed_outcomes
from tests.long_fit import fit_until_stopped

LIMIT = 10.0  # seconds from the signal until every rank is gone
ROOT = Path(__file__).resolve().parent.parent


def _wait_for_pids(pid_dir: str, deadline: float) -> dict[int, int]:
    while time.monotonic() < deadline:
        files = [Path(pid_dir, f"rank{r}") for r in (0, 1)]
        if all(f.exists() and f.read_text() for f in files):
            return {r: int(f.read_text()) for r, f in enumerate(files)}
        time.sleep(0.1)
    raise TimeoutError("the ranks did not start training")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _namings(target: int) -> list[str]:
    """How the other rank may name the signalled one: from its lost connection, from the failure
    board, or (rank 0 hosts the rendezvous store) from the store being gone."""
    who = f"rank {target} (dp_rank 0, pp_rank {target}, tp_rank 0)"
    names = [f"{who} received SIGTERM"]
    if target == 0:
        names.append(f"{who}, the process that hosts it, has stopped")
    return names


def signal_worker(pid_dir: str, target: int) -> None:
    rank = int(os.environ["RANK"])
    if rank != target:
        # The other rank sends the signal while the target is busy in the pipeline.
        import threading

        def send() -> None:
            pids = _wait_for_pids(pid_dir, time.monotonic() + 60)
            time.sleep(0.5)
            Path(pid_dir, "signalled").write_text(str(time.time()))
            os.kill(pids[target], signal.SIGTERM)

        threading.Thread(target=send, daemon=True).start()
    fit_until_stopped(pid_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("target", [0, 1])
def test_sigterm_with_an_external_launcher_stops_every_rank(
    target: int, capfd: pytest.CaptureFixture[str]
) -> None:
    with tempfile.TemporaryDirectory() as pid_dir:
        outcomes = run_distributed_outcomes(signal_worker, 2, pid_dir, target, timeout=90, init_group=False)
        signalled = float(Path(pid_dir, "signalled").read_text())
        ended = time.time()
    err = capfd.readouterr().err
    assert not any(o.killed for o in outcomes), outcomes
    assert outcomes[target].exitcode == 128 + signal.SIGTERM
    other = outcomes[1 - target]
    assert other.exitcode == 1 and other.error is not None
    assert any(naming in other.error for naming in _namings(target)), other.error[-2000:]
    line = f"lightning_pipe: rank {target} (dp_rank 0, pp_rank {target}, tp_rank 0) received SIGTERM"
    assert err.count(line) == 1, err[-3000:]
    assert ended - signalled < LIMIT + 2  # the harness polls every 50 ms and loads results


@pytest.mark.distributed
@pytest.mark.parametrize("target", [0, 1], ids=["parent-rank0", "child-rank1"])
def test_sigterm_with_lightnings_launcher_stops_every_rank(target: int) -> None:
    with tempfile.TemporaryDirectory() as pid_dir:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
        }
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
            env.pop(key, None)
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "long_fit.py"), pid_dir],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            pids = _wait_for_pids(pid_dir, time.monotonic() + 90)
            assert pids[0] == proc.pid  # rank 0 is the process we started; rank 1 its child
            time.sleep(0.5)
            start = time.monotonic()
            os.kill(pids[target], signal.SIGTERM)
            while any(_alive(pid) for pid in pids.values()) and time.monotonic() - start < 60:
                time.sleep(0.05)
            took = time.monotonic() - start
            output = proc.communicate(timeout=30)[0].decode(errors="replace")
        finally:
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert took < LIMIT, f"ranks still alive {took:.1f}s after SIGTERM:\n{output[-3000:]}"
    assert proc.returncode != 0
    line = f"lightning_pipe: rank {target} (dp_rank 0, pp_rank {target}, tp_rank 0) received SIGTERM"
    assert output.count(line) == 1, output[-3000:]
    if target == 1:  # rank 0 learns it from the lost connection and names the rank and the cause
        assert "rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) received SIGTERM (see its log)" in output, output[
            -3000:
        ]


def test_lightnings_sigterm_exception_exits_non_zero_and_names_rank_zero(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Lightning passes rank 0's SIGTERM on to every rank as ``SIGTERMException``, a ``SystemExit``
    without a code (exit status 0); under pipe_tp it says who received the signal and exits 1
    (143 on rank 0), whichever of that and the signal watcher wins the race."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_pipe.faults.signals import passed_on_by_rank_zero

    other = SIGTERMException()
    zero_named = "rank 0 (dp_rank 0, pp_rank 0, tp_rank 0)"
    passed_on_by_rank_zero(other, 1, "rank 1 (dp_rank 0, pp_rank 1, tp_rank 0)", zero_named)
    assert other.code == 1
    # The same words as the signal watcher's and the failure board's (test above accepts any).
    assert f"{zero_named} received SIGTERM" in capfd.readouterr().err
    assert any("rank 0 has stopped" in note for note in other.__notes__)
    zero = SIGTERMException()
    passed_on_by_rank_zero(zero, 0, "rank 0")
    assert zero.code == 128 + signal.SIGTERM


_EXPLAINED = """
import os, signal, sys, time
from lightning_pipe.faults.signals import StopOnSignal

def explain(signum):
    if sys.argv[1] == "hangs":
        time.sleep(60)  # a store on a node that went down may never answer
    return "sent by torchrun's agent: the store is unreachable"

StopOnSignal("rank 2 (test)", explain=explain).install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


@pytest.mark.parametrize("explain", ["answers", "hangs"])
def test_a_signal_says_why_it_came_when_the_process_can_tell_within_seconds(explain: str) -> None:
    """Under torchrun the agent may lose the rendezvous store (its node went down) before the ranks
    notice, and SIGTERM them: the one line says so where the process can tell. An explanation that
    does not come (a store that never answers) does not hold the exit up past ``EXPLAIN_S``."""
    from lightning_pipe.faults.signals import EXPLAIN_S

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXPLAINED, explain], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    took = time.monotonic() - start
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("lightning_pipe: "))
    if explain == "answers":
        assert line.startswith(
            "lightning_pipe: rank 2 (test) received SIGTERM (sent by torchrun's agent: the store is "
            "unreachable); stopping it now (exit code 143)"
        ), line
    else:
        assert line.startswith("lightning_pipe: rank 2 (test) received SIGTERM; stopping it now"), line
        assert EXPLAIN_S <= took < EXPLAIN_S + 20, took  # the interpreter's start included
