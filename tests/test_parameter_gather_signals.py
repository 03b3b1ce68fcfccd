"""ZeRO-1's parameter gather when a signal or another thread meets a wait in progress.

One process holds both gloo ranks of a two-rank group (built over one ``HashStore``, no
``init_process_group``): rank 0 is a real :class:`ParameterGather` over a two-layer model, and
"the peer" (rank 1) issues the matching all-gathers from a thread only when the test says, so a
wait on rank 0 lasts exactly as long as the test wants. Each case was a bug found by review:

* a signal handler on the training thread that waits for the gathers (Lightning's SLURM
  requeue handler saves a checkpoint) while the forward's own wait is in progress;
* Ctrl-C during that wait: gloo's wait cannot be interrupted, the ``KeyboardInterrupt`` comes
  after the gather completed, and must not mark the bucket torn;
* the teardown after a failure while another thread is inside an untimed wait: bounded by the
  grace, not by the group's timeout;
* a gather that failed (completed, with an error: its peer gone) is torn after the teardown.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import HashStore, ProcessGroupGloo
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

import lightning_pipe.data_parallel.parameter_gather as module
from lightning_pipe.data_parallel.parameter_gather import ParameterGather, TornParametersError, _ReadGuard
from lightning_pipe.data_parallel.reducer import BucketLayout, BucketView

PEER = 7.0
"""What the peer's half of every bucket holds after a gather."""


def _two_ranks() -> list[ProcessGroupGloo]:
    store, groups = HashStore(), [None, None]

    def build(rank: int) -> None:
        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=60)
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = ProcessGroupGloo(store, rank, 2, options)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups  # type: ignore[return-value]


class _Peer:
    def __init__(self, group: ProcessGroupGloo, gather: ParameterGather) -> None:
        self.group, self.gather = group, gather

    def join(self, delay: float = 0.0) -> threading.Thread:
        """Take part in rank 0's gathers (every bucket, in its launch order) after ``delay``."""

        def run() -> None:
            time.sleep(delay)
            works = [
                self.group._allgather_base(
                    torch.zeros_like(self.gather.buffers[k]), torch.full_like(self.gather.shards[k], PEER)
                )
                for k in self.gather._order
            ]
            for work in works:
                work.wait()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


Pair = tuple[nn.Sequential, ParameterGather, _Peer]


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    torch.set_num_threads(1)
    rank0, rank1 = _two_ranks()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    buckets = []
    for layer in reversed(model):  # a reducer's first buckets hold the last layers
        buffer = torch.zeros(layer.weight.numel())
        half = buffer.numel() // 2
        buckets.append(BucketView(((layer.weight, 0),), buffer, buffer[:half], range(0, half)))
    layout = BucketLayout(tuple(buckets), None, 2)  # type: ignore[arg-type]
    monkeypatch.setattr(
        module,
        "all_gather_flat",
        lambda output, input, group=None, async_op=False: rank0._allgather_base(output, input),
    )
    gather = ParameterGather(layout, overlap=True)
    gather.watch(list(model))
    yield model, gather, _Peer(rank1, gather)


def _complete(gather: ParameterGather) -> bool:
    return all(bool(buffer[buffer.numel() // 2 :].eq(PEER).all()) for buffer in gather.buffers)


def test_a_signal_handler_waiting_during_the_forwards_wait(pair: Pair) -> None:
    model, gather, peer = pair
    gather.launch()
    handled: list[bool] = []

    def wait_in_handler(*_: object) -> None:
        gather.wait_all()  # a checkpoint save from the handler
        handled.append(True)

    previous = signal.signal(signal.SIGUSR1, wait_in_handler)
    try:
        threading.Timer(0.2, lambda: (os.kill(os.getpid(), signal.SIGUSR1), peer.join(delay=0.3))).start()
        model(torch.ones(1, 4))  # the first layer's pre-hook waits; the handler waits inside it
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [True]
    assert not gather.pending and not gather._torn and _complete(gather)


def test_an_interrupt_during_the_forwards_wait_leaves_the_gather_whole(pair: Pair) -> None:
    model, gather, peer = pair
    gather.launch()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    joined: list[threading.Thread] = []
    try:
        timer = threading.Timer(
            0.2, lambda: (os.kill(os.getpid(), signal.SIGUSR1), joined.append(peer.join(0.3)))
        )
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            model(torch.ones(1, 4))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    joined[0].join(30)
    assert not gather._torn  # the gather completed: Ctrl-C came after it
    gather.abandon()  # Lightning: on_exception, then the teardown
    gather.close()
    gather.wait_all()  # a save after it: no TornParametersError
    assert not gather.pending and _complete(gather)


def test_the_teardown_after_a_failure_is_bounded_while_another_thread_waits(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, gather, peer = pair
    monkeypatch.setattr(module, "_CLOSE_GRACE", timedelta(seconds=0.3))
    gather.launch()
    reader = threading.Thread(target=gather.wait_all, daemon=True)  # a background reader, untimed
    reader.start()
    time.sleep(0.1)
    gather.abandon()
    started = time.monotonic()
    gather.close()  # the reader holds the lock: close leaves the gathers to its wait
    took = time.monotonic() - started
    assert took < 5.0, f"close() took {took:.1f} s"
    assert not gather._hooks
    peer.join().join(30)  # the peer was only slow: the reader's wait completes the gathers
    reader.join(30)
    assert not reader.is_alive() and not gather.pending and not gather._torn and _complete(gather)
    # The reader's wait could not reach this thread's mode stack: the guard stays there, inert,
    # until this thread's next wait (or forward) takes it off.
    assert gather._guard.on_stack() and not gather._guard.active
    gather.wait_all()
    assert not gather._guard.on_stack()


class _FailedWork:
    """A gather whose peer vanished: completed, with an error (as gloo's work is once the
    connection closes)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("Connection closed by peer")


def test_a_gather_that_failed_is_torn_after_the_teardown(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    _, gather, _ = pair
    monkeypatch.setattr(module, "all_gather_flat", lambda *args, **kwargs: _FailedWork())
    gather.launch()
    gather.abandon()
    gather.close()  # "completed" is not "succeeded": both buckets are torn
    with pytest.raises(TornParametersError, match=r"did not complete for 2 bucket\(s\)"):
        gather.wait_all()  # a save after the failure


class _UserMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))

    def on_stack(self) -> bool:
        return any(mode is self for mode in _get_current_function_mode_stack())


def test_a_retired_guard_left_on_the_stack_is_dropped_by_the_next_guard() -> None:
    """A teardown that left its guard to another thread's wait (above) leaves it, retired, on the
    training thread's stack; the next gather's guard takes it off instead of stacking on it."""
    left, other = _ReadGuard(set(), lambda: None), _ReadGuard(set(), lambda: None)
    left.insert()
    try:
        with _UserMode() as user_mode:  # a user's mode above it stays
            left.active = False
            other.insert()
            assert not left.on_stack() and other.on_stack() and user_mode.on_stack()
            assert other.remove()
    finally:
        left.remove()
