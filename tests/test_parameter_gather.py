"""ZeRO-1's overlapped parameter all-gather (``overlap_param_gather``), on the engine's pieces.

Two gloo ranks train a stack of linear layers with the sharding reducer and
:class:`~lightning_pipe.data_parallel.sharded_optimizer.ShardedOptimizer`, buckets small enough
that every layer has its own:

* the overlapped gather ends each step with the weights of the blocking gather, bit for bit, and
  of a replicated optimizer;
* it overlaps: when the next forward's first layer ran, later buckets' gathers were still pending,
  and nothing waited for all of them between the step and that forward;
* a weight read between the step and the next forward (``.detach().clone()``, ``state_dict()``)
  sees the full updated value, not this replica's slice only;
* a parameter whose storage is replaced after sharding is refused by name;
* a second ``optimizer.step()`` with no forward in between keeps its whole update;
* a user's torch-function mode around the step does not take the guard with it;
* after ``abandon()`` a read still waits; the teardown lets the gathers in flight complete, and
  one that cannot (a peer gone) makes later waits raise;
* another thread's wait and the training thread's forward never meet a half-waited bucket;
* watched layers stay deep-copyable and picklable (the copies have no waiting hook);
* a process ending right after its last gathers exits cleanly.

The Lightning side (callbacks, ``fit`` then ``validate``) is in ``tests/test_optimizer_sharding.py``.
"""

from __future__ import annotations

import copy
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from lightning_pipe.data_parallel.parameter_gather import ParameterAliasingError, TornParametersError
from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.sharded_optimizer import ShardedOptimizer
from tests.distributed import run_distributed

WIDTH, LAYERS, STEPS = 16, 4, 3


Run = tuple[nn.Sequential, torch.optim.Optimizer, GradientReducer, ShardedOptimizer | None]


def _setup(mode: str, width: int = WIDTH) -> Run:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    shard = mode != "replicated"
    bucket_mb = width * (width + 1) * 4 / 1024 / 1024  # one layer per bucket
    reducer = GradientReducer(list(model.parameters()), dist.group.WORLD, bucket_mb, shard=shard)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "replicated":
        return model, optimizer, reducer, None
    names = {id(p): n for n, p in model.named_parameters()}
    sharded = ShardedOptimizer(optimizer, reducer.layout(), overlap=mode == "overlapped", names=names)
    sharded.gather.watch(list(model))
    return model, optimizer, reducer, sharded


def _step(model: nn.Module, optimizer: Any, reducer: GradientReducer, sharded: Any, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    reducer.attach()
    reducer.arm()
    model(x).pow(2).mean().backward()
    reducer.finish()
    if sharded is not None:
        sharded.attach_gradients(reducer.used)
    optimizer.step()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def steps_worker() -> dict[str, Any]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    runs = {mode: _setup(mode) for mode in ("replicated", "blocking", "overlapped")}
    assert len(runs["overlapped"][2].shards) == LAYERS
    after: dict[str, list[dict[str, torch.Tensor]]] = {mode: [] for mode in runs}
    for _ in range(STEPS):
        for run in runs.values():
            _step(*run, x)
        # The next step's forward waits for the gathers; the weights are read after it.
        for mode, run in runs.items():
            with torch.no_grad():
                run[0](x)
            after[mode].append(_weights(run[0]))
    gather = runs["overlapped"][3].gather
    return {
        "modes_left": len(_get_current_function_mode_stack()),
        "after": after,
        "pending_at_first_forward": list(gather.record.pending_at_first_forward),
        "reads_caught": gather.record.reads_caught,
        "launches": gather.record.launches,
    }


@pytest.mark.distributed
def test_overlapped_gather_equals_the_blocking_one_and_overlaps_the_forward() -> None:
    for r in run_distributed(steps_worker, 2, timeout=120):
        for step in range(STEPS):
            for name, value in r["after"]["overlapped"][step].items():
                assert torch.equal(value, r["after"]["blocking"][step][name]), (step, name)
                torch.testing.assert_close(value, r["after"]["replicated"][step][name], atol=1e-6, rtol=0)
        assert r["launches"] == STEPS
        # Every step's forward began with the last layers' buckets still pending (one per layer:
        # the first layer waits for its own only), and nothing read a parameter in between.
        assert r["pending_at_first_forward"] == [LAYERS] * STEPS
        assert r["reads_caught"] == 0
        assert r["modes_left"] == 0, "the read guard is off the torch-function mode stack"


def read_worker(how: str) -> dict[str, Any]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    replicated, overlapped = _setup("replicated"), _setup("overlapped")
    gather = overlapped[3].gather
    reads, expected, before = [], [], []
    for _ in range(STEPS):
        before.append(overlapped[0][LAYERS - 1].weight.detach().clone())
        _step(*replicated, x)
        _step(*overlapped, x)
        assert gather.pending
        layer = overlapped[0][LAYERS - 1]  # its bucket is the last one the forward would wait for
        if how == "clone":
            reads.append(layer.weight.detach().clone())
        elif how == "state_dict":
            reads.append(overlapped[0].state_dict()[f"{LAYERS - 1}.weight"].clone())
        else:  # arithmetic on the parameter itself
            reads.append((layer.weight * 1.0).detach())
        assert not gather.pending
        expected.append(replicated[0][LAYERS - 1].weight.detach().clone())
        with torch.no_grad():
            overlapped[0](x)
            replicated[0](x)
    return {
        "reads": reads,
        "expected": expected,
        "before": before,
        "caught": gather.record.reads_caught,
        "modes_left": len(_get_current_function_mode_stack()),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["clone", "state_dict", "arithmetic"])
def test_a_read_between_the_step_and_the_forward_sees_the_updated_full_weight(how: str) -> None:
    for r in run_distributed(read_worker, 2, how, timeout=120):
        assert r["caught"] == STEPS
        # Caught inside its own handler, the guard could not pop itself: the forward did.
        assert r["modes_left"] == 0
        for read, expected, before in zip(r["reads"], r["expected"], r["before"], strict=True):
            torch.testing.assert_close(read, expected, atol=1e-6, rtol=0)
            assert not torch.equal(read, before), "the read must see this step's update"


def aliasing_worker() -> str:
    x = torch.randn(8, WIDTH)
    run = _setup("overlapped")
    _step(*run, x)
    run[3].gather.wait_all()
    layer = run[0][1]
    layer.weight.data = layer.weight.data.clone()  # cut off from its bucket's buffer
    try:
        _step(*run, x)
    except ParameterAliasingError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_parameter_replaced_after_sharding_is_refused_by_name() -> None:
    for message in run_distributed(aliasing_worker, 2, timeout=120):
        assert "parameter 1.weight as a view of its gradient bucket's flat parameter buffer" in message
        assert "param.data.copy_" in message


class _PassThrough(TorchFunctionMode):
    """A user's own torch-function mode (a profiler, a tracer): it only calls through."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def modes_worker() -> dict[str, Any]:
    x = torch.randn(8, WIDTH)
    run = _setup("overlapped")
    model, sharded = run[0], run[3]
    assert sharded is not None
    gather, stack = sharded.gather, _get_current_function_mode_stack
    _step(*run, x)
    seen: dict[str, Any] = {"guarded": len(stack())}
    with _PassThrough():  # pushed after the guard: the read goes through both, the guard waits
        model[-1].weight.detach().clone()
        seen["caught_under_user_mode"] = gather.record.reads_caught
    seen["after_user_mode"] = len(stack())  # the user's mode popped its own, not the guard
    with torch.no_grad():
        model(x)
    seen["after_forward"] = len(stack())
    _step(*run, x)
    with _PassThrough(), torch.no_grad():  # a forward under the user's mode: the guard is taken out
        model(x)  # from under it, and the user's exit pops the user's mode
        seen["inside_user_mode"] = [type(m).__name__ for m in stack()]
    seen["pending_after_forward"] = gather.pending
    with torch.no_grad():
        model(x)  # the next chance: popped
    seen["end"] = len(stack())
    return seen


@pytest.mark.distributed
def test_the_read_guard_leaves_other_torch_function_modes_alone() -> None:
    (seen,) = run_distributed(modes_worker, 1, timeout=60)
    assert seen["guarded"] == 1
    assert seen["caught_under_user_mode"] == 1
    assert seen["after_user_mode"] == 1, "the guard, inert, waits on the stack for the next forward"
    assert seen["after_forward"] == 0
    assert seen["inside_user_mode"] == ["_PassThrough"]
    assert not seen["pending_after_forward"]
    assert seen["end"] == 0


def double_step_worker(width: int) -> dict[str, Any]:
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    weights = {}
    for mode in ("overlapped", "blocking"):
        run = _setup(mode, width)
        for _ in range(STEPS):
            _step(*run, x)
            run[1].step()  # a second step on the same gradients: the first's gathers are in flight
        assert run[3] is not None
        run[3].gather.wait_all()
        weights[mode] = _weights(run[0])
    return weights


@pytest.mark.distributed
def test_a_second_step_before_the_gathers_are_waited_keeps_its_whole_update() -> None:
    # Wide layers, so that the first step's gathers are still in flight when the second one writes
    # this replica's slices (without the step's pre-hook, weights differed by up to 0.1).
    for r in run_distributed(double_step_worker, 2, 1024, timeout=240):
        for name, value in r["overlapped"].items():
            assert torch.equal(value, r["blocking"][name]), name


def user_mode_worker() -> dict[str, Any]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    replicated, overlapped = _setup("replicated"), _setup("overlapped")
    gather, stack = overlapped[3].gather, _get_current_function_mode_stack  # type: ignore[union-attr]
    seen: dict[str, Any] = {"reads": [], "expected": [], "after_with": [], "caught": []}
    for _ in range(STEPS):
        _step(*replicated, x)
        with _PassThrough():  # a user's mode (a profiler) whose `with` covers the step
            _step(*overlapped, x)
        seen["after_with"].append([type(m).__name__ for m in stack()])
        seen["reads"].append(overlapped[0][LAYERS - 1].weight.detach().clone())
        seen["caught"].append(gather.record.reads_caught)
        seen["expected"].append(replicated[0][LAYERS - 1].weight.detach().clone())
        with torch.no_grad():
            overlapped[0](x)
            replicated[0](x)
    seen["end"] = len(stack())
    return seen


@pytest.mark.distributed
def test_a_user_mode_around_the_step_pops_itself_not_the_guard() -> None:
    for seen in run_distributed(user_mode_worker, 2, timeout=120):
        # The user's exit popped the user's mode; the guard, under it, stayed and caught the read
        # of every step (each step's guard is on the stack again, whatever the last one met).
        assert seen["after_with"] == [["_ReadGuard"]] * STEPS
        assert seen["caught"] == list(range(1, STEPS + 1))
        for read, expected in zip(seen["reads"], seen["expected"], strict=True):
            torch.testing.assert_close(read, expected, atol=1e-6, rtol=0)
        assert seen["end"] == 0


def abandon_worker(done: str) -> dict[str, Any]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    replicated, overlapped = _setup("replicated"), _setup("overlapped")
    gather = overlapped[3].gather  # type: ignore[union-attr]
    _step(*replicated, x)
    _step(*overlapped, x)
    gather.abandon()  # an exception: nothing waited, nothing forgotten
    read = overlapped[0][LAYERS - 1].weight.detach().clone()
    seen: dict[str, Any] = {"read_caught": gather.record.reads_caught, "pending": gather.pending}
    seen["read"], seen["expected"] = read, replicated[0][LAYERS - 1].weight.detach().clone()
    # The next step, an exception with its gathers in flight, the teardown: every peer is alive,
    # so the gathers complete within close()'s grace, and a save after it sees whole weights.
    _step(*replicated, x)
    _step(*overlapped, x)
    gather.abandon()
    seen["pending_before_close"] = gather.pending
    gather.close()
    seen["pending_after_close"] = gather.pending
    gather.wait_all()  # a checkpoint save after the failure: no error
    seen["saved"] = _weights(overlapped[0])
    seen["saved_expected"] = _weights(replicated[0])
    # A peer gone: rank 1 takes no part in rank 0's next gathers, which then cannot complete. It
    # stays alive until rank 0 is done (a rank that had exited would make the launch itself fail,
    # on a closed connection, before there is anything to wait for).
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 60
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        from datetime import timedelta

        import lightning_pipe.data_parallel.parameter_gather as module

        module._CLOSE_GRACE = timedelta(seconds=0.5)
        lost = _setup("overlapped")[3].gather  # type: ignore[union-attr]
        lost.launch()
        lost.abandon()
        lost.close()
        try:
            lost.wait_all()
            seen["save"] = "no error"
        except TornParametersError as err:
            seen["save"] = str(err)
        Path(done).touch()
    return seen


@pytest.mark.distributed
def test_after_abandon_reads_wait_and_gathers_that_cannot_complete_refuse_saves(tmp_path: Path) -> None:
    for rank, seen in enumerate(run_distributed(abandon_worker, 2, str(tmp_path / "done"), timeout=120)):
        assert seen["read_caught"] == 1
        assert not seen["pending"]
        torch.testing.assert_close(seen["read"], seen["expected"], atol=1e-6, rtol=0)
        assert seen["pending_before_close"] and not seen["pending_after_close"]
        for name, value in seen["saved"].items():
            torch.testing.assert_close(value, seen["saved_expected"][name], atol=1e-6, rtol=0)
        if rank == 0:
            assert f"did not complete for {LAYERS} bucket(s) after an earlier failure" in seen["save"]
            for layer in range(LAYERS):
                assert f"{layer}.weight" in seen["save"] and f"{layer}.bias" in seen["save"]


def thread_worker() -> dict[str, Any]:
    # Another thread waits for the gathers (as the docs say a background reader should) while the
    # training thread's forward waits for them too: neither may see a bucket half-waited by the
    # other (before the lock: a spurious TornParametersError in 10 of 10 trials).
    width = 1024
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    overlapped, blocking = _setup("overlapped", width), _setup("blocking", width)
    gather = overlapped[3].gather  # type: ignore[union-attr]
    worst = 0.0
    for _ in range(10):
        _step(*overlapped, x)
        _step(*blocking, x)
        reader = threading.Thread(target=gather.wait_all)
        reader.start()
        with torch.no_grad():
            got = overlapped[0](x)
        reader.join()
        with torch.no_grad():
            worst = max(worst, (got - blocking[0](x)).abs().max().item())
    guards = [type(m).__name__ for m in _get_current_function_mode_stack()]
    return {"worst": worst, "modes": guards, "launches": gather.record.launches}


@pytest.mark.distributed
def test_another_thread_waiting_for_the_gathers_while_the_forward_runs() -> None:
    for seen in run_distributed(thread_worker, 2, timeout=180):
        assert seen["launches"] == 10
        assert seen["worst"] == 0.0  # the same weights as the blocking gather, bit for bit
        assert seen["modes"] == []  # the guard left this thread's stack


def copy_worker() -> dict[str, Any]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    overlapped, blocking = _setup("overlapped"), _setup("blocking")
    gather = overlapped[3].gather  # type: ignore[union-attr]
    _step(*overlapped, x)
    _step(*blocking, x)
    layer = overlapped[0][1]
    ema = copy.deepcopy(layer)  # after the step, gathers pending: the copy reads waited weights
    unpickled = pickle.loads(pickle.dumps(layer))
    seen: dict[str, Any] = {"copies": [], "hooks": []}
    for copied in (ema, unpickled):
        seen["copies"].append({n: t.detach().clone() for n, t in copied.state_dict().items()})
        seen["hooks"].append(
            [getattr(h, "__name__", type(h).__name__) for h in copied._forward_pre_hooks.values()]
        )
        copied(x)  # no gather to wait for: a copy's parameters are its own
    seen["expected"] = {n: t.detach().clone() for n, t in blocking[0][1].state_dict().items()}
    launches = gather.record.launches
    _step(*overlapped, x)
    _step(*blocking, x)
    with torch.no_grad():
        overlapped[0](x)  # the original's layers still wait for their buckets
    seen["launches"] = gather.record.launches - launches
    seen["met"] = gather.record.pending_at_first_forward
    seen["after"], seen["after_expected"] = _weights(overlapped[0]), _weights(blocking[0])
    return seen


@pytest.mark.distributed
def test_watched_layers_can_be_deep_copied_and_pickled() -> None:
    for seen in run_distributed(copy_worker, 2, timeout=120):
        assert seen["hooks"] == [["_no_wait"], ["_no_wait"]]
        for copied in seen["copies"]:
            for name, value in copied.items():
                torch.testing.assert_close(value, seen["expected"][name], atol=1e-6, rtol=0)
        assert seen["launches"] == 1 and seen["met"] == [LAYERS]
        for name, value in seen["after"].items():
            torch.testing.assert_close(value, seen["after_expected"][name], atol=0, rtol=0)


def _step_and_end(rank: int, port: int) -> None:
    """A whole process's life: step three times, wait for the last gathers, end the ordinary way
    (``destroy_process_group``, interpreter finalization), as a user's engine-level script does."""
    import os
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    run = _setup("overlapped", width=1024)  # 4 MiB buckets: the gathers outlast their waits' return
    x = torch.randn(64, 1024)
    for _ in range(STEPS):
        _step(*run, x)
    assert run[3] is not None
    run[3].gather.wait_all()
    dist.destroy_process_group()


def _launches_that_end(launches: int) -> None:
    """Run ``launches`` two-rank lives of :func:`_step_and_end`, each rank a child forked from
    this process (which imported torch and the package once), and print their exit codes.

    A child leaves by raising ``SystemExit`` out of this function, so it ends the ordinary way: the
    stack unwinds to the interpreter, which finalizes (atexit handlers, module teardown, gloo's
    threads still running), exactly what a spawned process does at its end, without paying for a
    fresh interpreter's imports per rank.
    """
    import json
    import os
    import sys
    import traceback

    # A rank's first optimizer imports Dynamo (``torch.optim.Optimizer.__init__``: 2.6 s of CPU),
    # which would be paid by each of the 12 forked ranks: imported here once, before the forks.
    import torch._dynamo  # noqa: F401

    from tests.distributed import free_port

    codes = []
    for _ in range(launches):
        port = free_port()
        pids = []
        for rank in range(2):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _step_and_end(rank, port)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
                raise SystemExit(0)
            pids.append(pid)
        deadline = time.monotonic() + 60
        statuses: dict[int, int | None] = dict.fromkeys(pids)
        while time.monotonic() < deadline and None in statuses.values():
            for pid in pids:
                if statuses[pid] is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        for pid in pids:
            if statuses[pid] is None:  # a hang: killed, reported as such
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                statuses[pid] = "killed after 60 s"  # type: ignore[assignment]
        codes.append([statuses[pid] for pid in pids])
    print(json.dumps(codes))


@pytest.mark.distributed
def test_a_process_ending_right_after_the_gathers_exits_cleanly() -> None:
    # A gather's work dropped right after its wait was destroyed on gloo's worker thread, which
    # then needed the GIL while the interpreter was finalizing: "terminate called without an
    # active exception", exit code -6, in 9 of 24 such launches (0 of 24 now: the works are kept
    # until the next launch). Six launches catch that rate with probability 1 - (15/24)^6 = 0.94.
    # The ranks are forked from one fresh interpreter and end through its finalization (see
    # _launches_that_end): a rank forked by the tests' launcher would skip finalization (it leaves
    # by os._exit), and a spawned one would import torch again for each of the 12 lives.
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = "from tests.test_parameter_gather import _launches_that_end; _launches_that_end(6)"
    done = subprocess.run(
        [sys.executable, "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(code == [0, 0] for code in codes), f"exit codes per launch: {codes}\n{done.stderr[-5000:]}"
