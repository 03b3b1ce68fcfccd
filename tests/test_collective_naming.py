"""A lost peer inside a collective that layers drive (tensor parallelism's, FSDP2's) is named like
one lost in the runtime's own collectives; the failure board outlives its host in each survivor.

Single-process checks of the parts; ``tests/test_lost_ranks.py`` kills ranks inside these
collectives and reads every survivor's error.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_pipe.data_parallel.fsdp_internals import collective_of
from lightning_pipe.faults.board import FaultBoard, PeerLostError, _Heartbeat
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.runtime.batch_faults import batch_collectives_named

ROOT = Path(__file__).resolve().parent.parent
LOST = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"


def _fsdp_function(name: str) -> Callable[[], None]:
    """A function called ``name`` whose frame looks like FSDP2's (its file under ``_fully_shard``)
    and that fails as gloo does when a peer's process has gone."""
    source = f"def {name}():\n    raise RuntimeError({LOST!r})\n"
    scope: dict[str, object] = {}
    exec(compile(source, "/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "exec"), scope)
    return scope[name]  # type: ignore[return-value]


def _raised(fn: Callable[[], None]) -> BaseException:
    try:
        fn()
    except BaseException as err:
        return err
    raise AssertionError("no error")


def test_the_fsdp2_collective_is_read_off_the_traceback() -> None:
    gather, reduce = _fsdp_function("foreach_all_gather"), _fsdp_function("foreach_reduce")
    assert collective_of(_raised(gather)) == "all-gathering parameters over the data-parallel group (FSDP2)"
    assert collective_of(_raised(lambda: reduce())) == (
        "reduce-scattering gradients over the data-parallel group (FSDP2)"
    )

    def foreach_reduce() -> None:  # our own function of that name is not FSDP2's
        raise RuntimeError(LOST)

    assert collective_of(_raised(foreach_reduce)) is None


def test_a_peer_lost_inside_fsdp2_becomes_a_peer_lost_error_naming_the_collective() -> None:
    board = FaultBoard(None, "test", 0, 4, lambda r: f"dp_rank {r // 2}")
    naming = CollectiveNaming(0, "dp_rank 0", board)
    with pytest.raises(PeerLostError) as caught, batch_collectives_named(naming, [0, 2]):
        _fsdp_function("foreach_reduce")()
    assert str(caught.value).startswith(
        "rank 0 (dp_rank 0) stopped while reduce-scattering gradients over the data-parallel group (FSDP2): "
        "rank 2 (dp_rank 1) has stopped. (Underlying error: [gloo"
    ), caught.value
    # Without FSDP2 (no data-parallel ranks given), or another error: unchanged.
    with pytest.raises(RuntimeError, match="Connection closed"), batch_collectives_named(naming, None):
        _fsdp_function("foreach_reduce")()
    with pytest.raises(ValueError), batch_collectives_named(naming, [0, 2]):
        raise ValueError("a bug")


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_flat", "reduce_scatter_flat", "wait"}


@pytest.mark.parametrize("module", ["regions.py", "cross_entropy.py"])
def test_every_tensor_parallel_collective_runs_inside_its_naming(module: str) -> None:
    """A collective added to the regions or the vocab-parallel loss without ``with named(...)``
    would surface a lost peer as the transport's bare error again."""
    tree = ast.parse((ROOT / "lightning_pipe" / "tensor_parallel" / module).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if name not in _COLLECTIVES:
            continue
        found.append(name)
        up = parents.get(node)
        while up is not None and not (
            isinstance(up, ast.With)
            and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", "") == "named"
                for i in up.items
            )
        ):
            up = parents.get(up)
        assert up is not None, f"{module}:{node.lineno}: {name}(...) outside `with named(...)`"
    assert found, module


@contextmanager
def _heartbeats() -> Iterator[None]:
    """This process's heartbeats set aside for the block (its boards' beats stop after it)."""
    saved = dict(_Heartbeat._started)
    _Heartbeat._started.clear()
    try:
        yield
    finally:
        for heartbeat in _Heartbeat._started.values():
            heartbeat._stop.set()
        _Heartbeat._started.clear()
        _Heartbeat._started.update(saved)


def test_a_survivor_keeps_the_board_and_the_host_stops_waiting_for_it() -> None:
    """The store's host, failing, waits only until the others hold a copy of the board (not its
    five seconds); a survivor that then finds the store gone names the cause from its copy."""
    store = dist.HashStore()
    with _heartbeats():
        host = FaultBoard(store, "call/1", 0, 2, lambda r: f"pp_rank {r}")
        other = FaultBoard(store, "call/1", 1, 2, lambda r: f"pp_rank {r}")
        start = time.monotonic()
        host.report_victim("lost its peer while all-gathering the sequence: rank 2 vanished")
        waited = time.monotonic() - start
        assert waited < 3.0, f"the host waited {waited:.1f}s for a rank that held the board"
        try:
            other.store = _Gone()  # type: ignore[assignment]
            said = other.explain_lost([0])
        finally:
            other.store = store
    assert said == (
        "rank 0 (pp_rank 0) stopped after it lost its peer while all-gathering the sequence: rank 2 vanished "
        "(read from the failure board before its host, rank 0 (pp_rank 0), stopped)"
    ), said


class _Gone:
    """A store whose host has stopped."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        def fail(*args: object) -> None:
            raise RuntimeError("Connection reset by peer")

        return fail


def test_the_board_says_when_its_store_no_longer_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rank signalled by torchrun's agent asks (``store_lost``): ``None`` while the store
    answers; once it is gone, the words naming the node whose agent hosted it."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    board = FaultBoard(dist.HashStore(), "call/1", 2, 4, lambda r: f"pp_rank {r % 2}")
    board.nodes = ["node 0 (host-a)", "node 0 (host-a)", "node 1 (host-b)", "node 1 (host-b)"]
    assert board.store_lost() is None
    board.store = _Gone()  # type: ignore[assignment]
    assert board.store_lost() == (
        "the rendezvous store in torchrun's agent on node 0 (host-a), with ranks 0, 1 is unreachable: "
        "that node's launcher has stopped (the node went down, or its agent was killed or ended)"
    )
