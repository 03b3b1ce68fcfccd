"""Faults outside the schedule end every rank quickly with messages that name the rank and the fix:

* ``trainer.save_checkpoint`` under ``if trainer.is_global_zero:`` fails on rank 0 with the fix,
  and the other rank names rank 0 as the first failure, instead of both waiting for the deadline;
* a rank that vanishes while its neighbour is sending ends the neighbour with a
  ``PipelineCommunicationError`` that names it, never a bare transport error;
* an exception in a callback on one rank is named in the other rank's error.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed_outcomes
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import quiet_trainer

pytestmark = pytest.mark.distributed

DATA = dataset(32, seed=1)
DEADLINE = timedelta(seconds=40)
SAVE_DEADLINE = timedelta(seconds=20)


def _trainer(
    root: str,
    callbacks: list[L.Callback] | None = None,
    max_steps: int = 3,
    deadline: timedelta = DEADLINE,
) -> L.Trainer:
    """pp=2 on two ranks, with the short exchange deadline."""
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=deadline)
    return quiet_trainer(strategy, 2, root, max_steps=max_steps, callbacks=callbacks or [])


def rank_zero_save_worker(root: str) -> None:
    model = Regressor()
    # A shorter deadline: the save waits half of it for the other rank, which never comes.
    trainer = _trainer(root, deadline=SAVE_DEADLINE)
    trainer.fit(model, loader(DATA, 8, reference=False))
    if trainer.is_global_zero:  # the habit from other strategies
        trainer.save_checkpoint(os.path.join(root, "only-rank-0.ckpt"))
    trainer.validate(model, loader(DATA, 8, reference=False), verbose=False)


def test_save_checkpoint_on_one_rank_says_to_call_it_everywhere() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(rank_zero_save_worker, 2, root, timeout=150, init_group=False)
    assert all(o.exitcode == 1 and not o.killed for o in outcomes), outcomes
    first, second = (o.error or "" for o in outcomes)
    assert (
        "CheckpointError: Saving a checkpoint on rank 0: not every rank started the save within 10s" in first
    )
    assert "call it on every rank (not under `if trainer.is_global_zero:`)" in first
    # Rank 1 waits in the store (creating the next call's groups) until rank 0's process ends, so
    # it can read no report: it names rank 0 as the store's host that stopped, whose log has why.
    assert (
        "The first rank to fail: rank 0 (dp_rank 0, pp_rank 0, tp_rank 0) raised CheckpointError: Saving a "
        "checkpoint on rank 0"
        in second
        or "rank 0 (dp_rank 0, pp_rank 0, tp_rank 0), the process that hosts it, has stopped" in second
    ), second[-2000:]
    # Rank 0 gives up after half the 20 s deadline; rank 1, still waiting, follows at once.
    assert outcomes[1].seconds - outcomes[0].seconds < 10


class Vanish(L.Callback):
    """Rank 1 ends its process abruptly in the middle of step 2, inside its first layer's forward,
    while rank 0 is sending it the next micro-batch's activations."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            first = list(pl_module.layers)[trainer.strategy.runtime.partition.layer_range(1)[0]]  # type: ignore[attr-defined]
            first.register_forward_pre_hook(lambda *args: os._exit(3) if trainer.global_step == 2 else None)


def vanish_worker(root: str) -> None:
    _trainer(root, [Vanish()]).fit(Regressor(), loader(DATA, 8, reference=False))


def test_a_vanished_neighbour_is_named_mid_exchange() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(vanish_worker, 2, root, timeout=120, init_group=False)
    assert outcomes[1].exitcode == 3
    error = outcomes[0].error or ""
    assert outcomes[0].exitcode == 1, outcomes
    assert "PipelineCommunicationError: Pipeline rank 0 (global rank 0, stages [0]) gave up on" in error
    assert "with peer rank 1 after" in error, error[-2000:]
    # os._exit(3) reports nothing: to its peer the rank vanished, as a killed one does.
    assert "rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) vanished without an error of its own" in error
    assert "RuntimeError: [" not in error and "The above exception" not in error
    assert outcomes[0].seconds < 30


def exit_before_step_worker(root: str) -> None:
    class Exit(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_rank == 1 and trainer.global_step == 2:
                os._exit(3)

    _trainer(root, [Exit()]).fit(Regressor(), loader(DATA, 8, reference=False))


def test_a_vanished_rank_is_named_by_the_step_agreement() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(exit_before_step_worker, 2, root, timeout=120, init_group=False)
    error = outcomes[0].error or ""
    assert outcomes[0].exitcode == 1, outcomes
    assert (
        "PeerLostError: rank 0 (dp_rank 0, pp_rank 0, tp_rank 0) stopped while checking that the replica's "
        "ranks run the same batch (training_step of batch 2): rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) "
        "vanished without an error of its own" in error
    ), error[-2000:]


class FailsOnRankOne(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            raise ValueError("a bug in a callback on rank 1")


def callback_worker(root: str) -> None:
    _trainer(root, [FailsOnRankOne()]).fit(Regressor(), loader(DATA, 8, reference=False))


def test_an_exception_in_a_callback_is_named_on_the_other_rank() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(callback_worker, 2, root, timeout=120, init_group=False)
    assert all(o.exitcode == 1 and not o.killed for o in outcomes), outcomes
    assert "ValueError: a bug in a callback on rank 1" in (outcomes[1].error or "")
    error = outcomes[0].error or ""
    assert (
        "rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) raised ValueError: a bug in a callback on rank 1" in error
    ), error[-2000:]
    assert outcomes[0].seconds < 30


class Hyper:
    """A hyper-parameter object that ``torch.load(weights_only=True)`` refuses."""


class WithObjectHparams(Regressor):
    def __init__(self, thing: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def weights_only_worker(root: str) -> dict[str, str]:
    path = os.path.join(root, "objects.ckpt")
    trainer = _trainer(root)
    trainer.fit(WithObjectHparams(Hyper()), loader(DATA, 8, reference=False))
    trainer.save_checkpoint(path)
    out = {}
    try:  # the default refuses the object, with an error that names weights_only=False
        _trainer(root).fit(WithObjectHparams(Hyper()), loader(DATA, 8, reference=False), ckpt_path=path)
        out["default"] = "no error"
    except Exception as err:
        out["default"] = f"{type(err).__name__}: {err}"
    resumed = _trainer(root, max_steps=5)
    resumed.fit(
        WithObjectHparams(Hyper()), loader(DATA, 8, reference=False), ckpt_path=path, weights_only=False
    )
    out["trusted"] = f"resumed at step 3, ended at {resumed.global_step}"
    return out


def test_fit_with_weights_only_false_resumes_a_checkpoint_holding_objects() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(weights_only_worker, 2, root, timeout=150, init_group=False)
    assert all(o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        assert "weights_only=False" in o.result["default"], o.result["default"]
        assert o.result["trusted"] == "resumed at step 3, ended at 5"
