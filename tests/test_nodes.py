"""Several nodes, simulated on one machine: the launchers' multi-node paths, a checkpoint moved
between node counts, and a lost node.

* ``torchrun --nnodes 2 --nproc-per-node 2`` with a c10d rendezvous on localhost (two agents, one
  per "node") trains ``tests/two_nodes.py`` (a tiny GPT at pp=2 x tp=2: each stage's tensor group
  on one node, the pipeline across the two) to one device's losses, states in the layout log which
  node holds which ranks, and writes a sharded checkpoint from both nodes into one directory.
* That checkpoint resumes on one node (4 processes), under SLURM's variables on four nodes of one
  task (pp=4: another node count and layout), and under Lightning's own launcher started once per
  node with ``NODE_RANK`` (each starts its node's second process), continuing on the same losses.
* SIGKILL to every process of one node (its torchrun agent and its ranks, as a node going down):
  the other node's ranks end within seconds, naming the lost node and its ranks. Node 0, whose
  agent hosts the store, under torchrun; node 1 (the store alive) on forked ranks with torchrun's
  environment, since no agent takes part in naming it.

Each launch costs fresh interpreters (seconds of imports on two cores), so the tests share one
training run (a module fixture), use as few launches as make the points, and fork from the test
harness's fork server (imports done) every process that no launcher under test starts: the
resumes' ranks, each node's first process under Lightning's launcher, node 1's lost ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import lightning as L
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from tests.distributed import free_port, run_distributed, run_distributed_outcomes, run_script, script_main
from tests.gpt_models import TinyGPT, token_data
from tests.trainers import fit
from tests.two_nodes import BATCH, CHECKPOINT, SAMPLES

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "two_nodes.py"
STEPS_PER_EPOCH = SAMPLES // BATCH
LAUNCH_S = 240.0
"""A launch that has not ended by then hangs: it is killed and the test fails."""
LOST_NODE_S = 30.0
"""From the kill of a node to the end of the other node's ranks (their exchange deadline: 60 s)."""


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.values[trainer.global_step - 1] = float(outputs["loss"])


@pytest.fixture(scope="module")
def one_device() -> dict[int, float]:
    """The reference: two epochs on one process, with the sampler pipe_tp gets (dp=1, seed 0)."""
    data = token_data(SAMPLES)
    losses = Losses()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    fit(
        TinyGPT(),
        "auto",
        1,
        DataLoader(data, batch_size=BATCH, sampler=sampler),
        max_epochs=2,
        callbacks=[losses],
    )
    return losses.values


def _environ() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        env.pop(key, None)
    return env


class _Nodes:
    """The launches of two "nodes", each a process group of its own writing to its own log; on
    leaving the ``with`` block every one still running is killed (SIGKILL to its group) and
    :attr:`outputs` holds what each wrote."""

    def __init__(self, folder: Path, name: str) -> None:
        self.logs = [open(folder / f"{name}{node}.log", "w+b") for node in (0, 1)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.outputs: list[str] = []

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start the next node's launch (its output to that node's log)."""
        log = self.logs[len(self.processes)]
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(process)
        return process

    def __enter__(self) -> _Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        _end(self.processes)
        self.outputs = _read(self.logs)
        for log in self.logs:
            log.close()


def _torchrun_agents(root: Path, args: list[str], nodes: _Nodes) -> list[subprocess.Popen[bytes]]:
    """Two torchrun agents on localhost, 2 processes each, meeting at a c10d rendezvous; the first
    hosts the rendezvous store (``is_host``), each is its own process group. (No ``--node-rank``:
    c10d ignores it and numbers the agents itself, so a node's rank is read from its ranks.)"""
    port = free_port()
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nodes-{port}",
            f"--rdzv-conf=is_host={int(node == 0)}", "--max-restarts=0",
            str(SCRIPT), "--root", str(root), *args,
        ]  # fmt: skip
        nodes.start(command, _environ())
    return nodes.processes


def _end(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _wait(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"a launch still ran after {timeout:.0f} s (hang?)") from None
    return [p.returncode for p in processes]


def _read(logs: list[IO[bytes]]) -> list[str]:
    texts = []
    for log in logs:
        log.flush()
        log.seek(0)
        texts.append(log.read().decode(errors="replace"))
    return texts


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[int, float], list[str]]]:
    """One epoch under two torchrun agents: the root (with the checkpoint), the losses and each
    agent's output (its ranks' output)."""
    root = tmp_path_factory.mktemp("two-nodes")
    start = time.monotonic()
    with _Nodes(root, "agent") as nodes:
        codes = _wait(_torchrun_agents(root, ["--save", "--tag", "torchrun"], nodes), LAUNCH_S)
    outputs = nodes.outputs
    print(f"two torchrun agents: {time.monotonic() - start:.1f} s")
    assert codes == [0, 0], "\n".join(o[-4000:] for o in outputs)
    yield root, _run(root, "torchrun", "TorchElasticEnvironment", [0, 0, 1, 1]), outputs


def _assert_same(got: dict[int, float], one: dict[int, float], steps: range, what: str) -> None:
    assert sorted(got) == list(steps), (what, got)
    for step in steps:
        assert got[step] == pytest.approx(one[step], abs=1e-5), f"{what}, step {step}"


def test_two_torchrun_agents_train_like_one_device_with_each_tensor_group_on_one_node(
    two_nodes: tuple[Path, dict[int, float], list[str]], one_device: dict[int, float]
) -> None:
    root, losses, outputs = two_nodes
    _assert_same(losses, one_device, range(STEPS_PER_EPOCH), "pp=2 x tp=2 on 2 torchrun nodes")
    log = "".join(outputs)
    host = os.uname().nodename
    assert "nodes: 2; each tensor-parallel group inside one node" in log, log[-4000:]
    assert f"node 0 ({host}): ranks 0-1: dp_rank 0 pp_rank 0" in log, log[-4000:]
    assert f"node 1 ({host}): ranks 2-3: dp_rank 0 pp_rank 1" in log, log[-4000:]
    # One sharded checkpoint, written by both nodes' ranks into one directory.
    ckpt = root / CHECKPOINT
    assert (ckpt / "pipe_tp_metadata.json").is_file(), sorted(p.name for p in root.iterdir())


def _run(root: Path, tag: str, environment: str, nodes: list[int]) -> dict[int, float]:
    """The losses of run ``tag``, checked to have run under Lightning's ``environment`` with its
    ranks on ``nodes`` (node rank by global rank)."""
    run = json.loads((root / f"losses-{tag}.json").read_text())
    assert (run["environment"], run["nodes"]) == (environment, nodes), run
    return {int(k): v for k, v in run["losses"].items()}


RESUME = ["--resume", "--epochs", "2"]
SECOND_EPOCH = range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)


def test_the_two_node_checkpoint_resumes_on_one_node(
    two_nodes: tuple[Path, dict[int, float], list[str]], one_device: dict[int, float]
) -> None:
    """The same pp=2 x tp=2 layout in four processes of one node (torchrun's environment)."""
    root = two_nodes[0]
    argv = ["--root", str(root), "--nodes", "1", "--devices", "4", "--tag", "one-node", *RESUME]
    run_script(SCRIPT, argv, 4, ROOT, timeout=LAUNCH_S)
    _assert_same(
        _run(root, "one-node", "LightningEnvironment", [0, 0, 0, 0]),
        one_device,
        SECOND_EPOCH,
        "resumed on one node",
    )


def slurm_task(argv: list[str]) -> None:
    """One task of ``srun --nodes 4 --ntasks-per-node 1``: the variables srun sets (and Lightning's
    ``SLURMEnvironment`` reads) instead of torchrun's; the rendezvous address stays ``MASTER_*``."""
    rank = int(os.environ.pop("RANK"))
    for key in ("WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key)
    os.environ.update(
        SLURM_JOB_NAME="two_nodes", SLURM_JOB_ID="4401", SLURM_NTASKS="4", SLURM_NNODES="4",
        SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank),
        SLURM_NODELIST="127.0.0.1",
    )  # fmt: skip
    from tests.two_nodes import main

    main(argv)


def test_the_two_node_checkpoint_resumes_under_slurm_on_four_nodes_at_pp4(
    two_nodes: tuple[Path, dict[int, float], list[str]], one_device: dict[int, float]
) -> None:
    """Another node count and layout: four SLURM "nodes" of one task, pp=4, tp=1 (a tensor group
    of one fits any node)."""
    root = two_nodes[0]
    argv = ["--root", str(root), "--nodes", "4", "--devices", "1", "--pp", "4", "--tp", "1"]
    run_distributed(slurm_task, 4, [*argv, "--tag", "slurm", *RESUME], timeout=LAUNCH_S, init_group=False)
    _assert_same(
        _run(root, "slurm", "SLURMEnvironment", [0, 1, 2, 3]),
        one_device,
        SECOND_EPOCH,
        "resumed under SLURM on 4 nodes",
    )


def lightning_node(argv: list[str], log: str) -> None:
    """``python tests/two_nodes.py *argv`` on node ``RANK`` of two, with ``NODE_RANK``, ``MASTER_ADDR``
    and ``MASTER_PORT`` set as a user sets them on each node (no ``RANK``, ``WORLD_SIZE`` or
    ``LOCAL_RANK``: Lightning's launcher starts the node's other process itself), its output, and
    that process's, to ``log{RANK}``; waits for the process it started, which must succeed."""
    node = os.environ.pop("RANK")
    for key in ("WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key)
    os.environ.update(NODE_RANK=node, PYTHONPATH=str(ROOT))
    out = os.open(f"{log}{node}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd in (1, 2):
        os.dup2(out, fd)
    try:
        script_main(str(SCRIPT), argv, str(ROOT))
    finally:
        ended = []
        while True:
            try:
                ended.append(os.wait()[1])
            except ChildProcessError:
                break
    assert ended and all(status == 0 for status in ended), f"node {node}'s other process ended with {ended}"


def test_lightnings_launcher_started_per_node_with_node_rank_resumes_it(
    two_nodes: tuple[Path, dict[int, float], list[str]], one_device: dict[int, float]
) -> None:
    """``python tests/two_nodes.py`` once per node with ``NODE_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, ``Trainer(num_nodes=2, devices=2)``: Lightning's launcher starts each node's
    second process; together they resume the torchrun run's checkpoint at pp=2 x tp=2. (Each
    node's first process is forked by the test harness, as ``run_script`` does, instead of a fresh
    interpreter: Lightning's launcher, what this tests, starts the second one.)"""
    root = two_nodes[0]
    log = str(root / "lightning-node")
    argv = ["--root", str(root), "--tag", "lightning", *RESUME]
    run_distributed(lightning_node, 2, argv, log, timeout=LAUNCH_S, init_group=False)
    outputs = [Path(f"{log}{node}").read_text(errors="replace") for node in (0, 1)]
    assert "node 1 (" in outputs[0] and "ranks 2-3: dp_rank 0 pp_rank 1" in outputs[0], outputs[0][-4000:]
    _assert_same(
        _run(root, "lightning", "LightningEnvironment", [0, 0, 1, 1]),
        one_device,
        SECOND_EPOCH,
        "resumed with NODE_RANK",
    )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _ranks_training(pid_dir: Path, world: int, agents: list[subprocess.Popen[bytes]]) -> dict[int, Any]:
    deadline = time.monotonic() + LAUNCH_S
    while time.monotonic() < deadline:
        files = [pid_dir / f"rank{r}.json" for r in range(world)]
        if all(f.exists() for f in files):
            return {r: json.loads(f.read_text()) for r, f in enumerate(files)}
        if any(a.poll() is not None for a in agents):
            raise RuntimeError("an agent ended before its ranks trained")
        time.sleep(0.1)
    raise TimeoutError(f"the ranks did not start training within {LAUNCH_S:.0f} s")


def _named(down: int) -> str:
    """The words a survivor's error names node ``down`` with."""
    host = os.uname().nodename
    return {
        1: f"node 1 ({host}) is lost: all of its ranks (2, 3) stopped at once without an error of their own",
        0: f"the rendezvous store in torchrun's agent on node 0 ({host}), with ranks 0, 1 is unreachable: "
        "that node's launcher has stopped (the node went down",
    }[down]


def test_a_lost_node_hosting_the_store_ends_the_other_nodes_ranks_within_seconds_naming_it(
    tmp_path: Path,
) -> None:
    """A node goes down mid-training (SIGKILL to its torchrun agent's process group and to its ranks,
    each of which torchrun starts in a session of its own): the other node's ranks, blocked in
    exchanges with them, end within seconds (their deadline is 60 s), and their error names the
    lost node and its ranks, not only the one peer each was exchanging with. Node 0's agent hosts
    the store the ranks share: when it goes, the survivors say that store's node went down. (Node
    1 lost, the store alive: :func:`test_a_lost_node_without_the_store_is_named_by_the_other_nodes_ranks`.)"""
    down = 0
    with _Nodes(tmp_path, "agent") as nodes:
        agents = _torchrun_agents(tmp_path, ["--until-killed", "--tag", "killed"], nodes)
        ranks = _ranks_training(tmp_path / "pids", 4, agents)
        lost = [r for r, where in ranks.items() if where["node"] == down]
        survivors = [r for r in ranks if r not in lost]
        gone = next(a for a in agents if a.pid == ranks[lost[0]]["launcher"])
        other = next(a for a in agents if a is not gone)
        killed = time.monotonic()
        os.killpg(gone.pid, signal.SIGKILL)
        for r in lost:
            os.kill(ranks[r]["pid"], signal.SIGKILL)
        while any(_alive(ranks[r]["pid"]) for r in survivors) and time.monotonic() - killed < 2 * LOST_NODE_S:
            time.sleep(0.05)
        took = time.monotonic() - killed
        code = _wait([other], LOST_NODE_S)[0]
    outputs = nodes.outputs
    print(f"node {1 - down}'s ranks ended {took:.1f} s after node {down} was killed")
    output = outputs[agents.index(other)]
    assert lost == [2 * down, 2 * down + 1], ranks
    assert took < LOST_NODE_S, (
        f"ranks {survivors} still ran {took:.1f} s after node {down} was lost:\n{output[-4000:]}"
    )
    assert code != 0
    named = _named(down)
    # A survivor's first line (before its traceback) names the node, whichever peer it lost; torchrun
    # ends the other ranks of a node as soon as one fails (SIGTERM), which may come first.
    said = [line for line in output.splitlines() if line.startswith("lightning_pipe: ")]
    naming = 0
    for r in survivors:
        mine = [
            line
            for line in said
            if f"(global rank {r}," in line or line.startswith(f"lightning_pipe: rank {r} (")
        ]
        naming += any(named in line for line in mine)
        ended = any("received SIGTERM (torchrun sends SIGTERM to every rank" in line for line in mine)
        assert any(named in line for line in mine) or ended, (r, said, output[-4000:])
    assert naming >= 1, (said, output[-4000:])


def torchrun_rank(argv: list[str]) -> None:
    """One rank of ``torchrun --nnodes 2 --nproc-per-node 2``, with the environment torchrun's agent
    gives it (its node's rank ``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, a run id), but
    forked by the test harness: no agent, the rendezvous store in global rank 0 (on node 0)."""
    rank = int(os.environ["RANK"])
    os.environ.update(
        GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="nodes",
    )  # fmt: skip
    from tests.two_nodes import main

    main(argv)


def test_a_lost_node_without_the_store_is_named_by_the_other_nodes_ranks(tmp_path: Path) -> None:
    """Node 1 goes down mid-training (SIGKILL to both of its ranks at once) while the store lives
    on, on node 0: the other node's ranks, blocked in exchanges with them, end within seconds and
    each names the lost node and all of its ranks, not only the one peer it was exchanging with.
    The agents are not what this tests (the store's node going down, agent and all, is
    :func:`test_a_lost_node_hosting_the_store_ends_the_other_nodes_ranks_within_seconds_naming_it`):
    the ranks are forked with torchrun's environment, seconds of imports cheaper than torchrun."""
    pid_dir = tmp_path / "pids"
    ended = threading.Event()
    seen: dict[str, Any] = {}

    def kill_node_one() -> None:
        files = [pid_dir / f"rank{r}.json" for r in range(4)]
        while not all(f.exists() for f in files):
            if ended.wait(0.1):
                return
        ranks = {r: json.loads(f.read_text()) for r, f in enumerate(files)}
        seen["ranks"] = ranks
        lost = [r for r, where in ranks.items() if where["node"] == 1]
        killed = time.monotonic()
        for r in lost:
            os.kill(ranks[r]["pid"], signal.SIGKILL)
        while any(_alive(ranks[r]["pid"]) for r in ranks if r not in lost):
            if time.monotonic() - killed > 2 * LOST_NODE_S:
                break
            time.sleep(0.05)
        seen["took"] = time.monotonic() - killed

    killer = threading.Thread(target=kill_node_one, daemon=True)
    killer.start()
    argv = ["--root", str(tmp_path), "--until-killed", "--tag", "killed"]
    try:
        outcomes = run_distributed_outcomes(torchrun_rank, 4, argv, timeout=LAUNCH_S, init_group=False)
    finally:
        ended.set()
        killer.join()
    assert "ranks" in seen, ("the ranks did not train", outcomes)
    ranks = seen["ranks"]
    lost = [r for r, where in ranks.items() if where["node"] == 1]
    assert lost == [2, 3], ranks
    took = seen["took"]
    print(f"node 0's ranks ended {took:.1f} s after node 1 was killed")
    assert took < LOST_NODE_S, (f"ranks 0, 1 still ran {took:.1f} s after node 1 was lost", outcomes)
    named = _named(1)
    for o in outcomes[:2]:
        assert not o.killed and o.exitcode == 1, o
        assert named in (o.error or ""), (o.rank, (o.error or "")[-4000:])
