"""A rank that vanishes (SIGKILL, the out-of-memory killer) or raises is named by every survivor.

A killed rank leaves no log, so the survivors' errors are all the user gets: each must name the
rank that stopped and say how (vanished without an error of its own, or raised), never blame the
rank that hosts the rendezvous store while it is alive, and never a vague "one of ranks [...]".
The ranks are started by the test harness, which (like SLURM's ``srun``) does not kill the others
when one dies, so every survivor meets the loss itself.
"""

from __future__ import annotations

import os
import signal
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest

from lightning_pipe import PipeTPStrategy
from tests.distributed import Outcome, run_distributed_outcomes
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

pytestmark = pytest.mark.distributed

DATA = dataset(64, seed=1)
VANISHED = "vanished without an error of its own"


class Die(L.Callback):
    """Rank ``rank`` ends at step 2: SIGKILL (``how="kill"``) or a ValueError, in the forward of its
    stage's first layer, in the optimizer step, or while a checkpoint is saved."""

    def __init__(self, rank: int, where: str, how: str = "kill") -> None:
        self.rank, self.where, self.how = rank, where, how

    def _die(self) -> None:
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"a bug on rank {self.rank}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        if self.where == "forward":
            layer = runtime.layers[runtime.partition.layer_range(runtime.stage_indices[0])[0]]
            layer.register_forward_pre_hook(lambda *_: self._die() if trainer.global_step == 2 else None)
        elif self.where == "step":
            trainer.optimizers[0].register_step_post_hook(
                lambda *_: self._die() if trainer.global_step == 2 else None
            )

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.where == "save" and trainer.global_step == 2:
            trainer.save_checkpoint(os.path.join(trainer.default_root_dir, "mid.ckpt"))

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        if self.where == "save" and trainer.global_rank == self.rank:
            self._die()


def worker(root: str, devices: int, pp: int, die: Die, options: dict[str, Any]) -> None:
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, num_microbatches=4, timeout=timedelta(seconds=60), **options
    )
    fit(Regressor(), strategy, devices, loader(DATA, 8, reference=False), root, max_steps=4, callbacks=[die])


def _run(devices: int, pp: int, die: Die, **options: Any) -> list[Outcome]:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(
            worker, devices, root, devices, pp, die, options, timeout=150, init_group=False
        )
    target = outcomes[die.rank]
    assert target.exitcode == (-signal.SIGKILL if die.how == "kill" else 1), outcomes
    for o in outcomes:
        assert not o.killed, f"rank {o.rank} hung"
    return [o for o in outcomes if o.rank != die.rank]


def _last_line(o: Outcome) -> str:
    lines = (o.error or "").strip().splitlines()
    # The final exception's message (its notes follow it).
    return next((line for line in reversed(lines) if "Error: " in line), lines[-1] if lines else "")


def test_a_killed_middle_stage_is_named_by_both_neighbours() -> None:
    survivors = _run(3, 3, Die(1, "forward"))
    for o in survivors:
        assert o.exitcode == 1, o
        line = _last_line(o)
        assert f"rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) {VANISHED}" in line, line
        assert "SIGKILL" in line and "out-of-memory" in line, line
        assert "one of ranks" not in (o.error or "") and "rendezvous store" not in (o.error or "")


def test_a_rank_killed_in_the_sharded_optimizer_step_is_named_by_every_survivor() -> None:
    survivors = _run(4, 2, Die(3, "step"), shard_optimizer_state=True)
    for o in survivors:
        line = _last_line(o)
        assert o.exitcode == 1 and f"rank 3 (dp_rank 1, pp_rank 1, tp_rank 0) {VANISHED}" in line, line
        assert "one of ranks" not in (o.error or ""), o.error


def test_a_rank_killed_while_saving_is_named() -> None:
    survivors = _run(4, 2, Die(2, "save"), shard_optimizer_state=True)
    for o in survivors:
        assert o.exitcode == 1, o
        line = _last_line(o)
        # A rank blocked in a collective with rank 0 learns of the loss when rank 0's process ends,
        # and then can only say that rank 0 (the store's host) stopped, pointing at its log.
        named = f"rank 2 (dp_rank 1, pp_rank 0, tp_rank 0) {VANISHED}" in line
        host = "rank 0 (dp_rank 0, pp_rank 0, tp_rank 0), the process that hosts it, has stopped" in line
        assert named or (host and o.rank != 0), line
        assert "Connection reset by peer" not in line.split("(Underlying error")[0], line
    assert VANISHED in _last_line(survivors[0])  # rank 0 itself names rank 2


def test_a_raise_on_stage_one_of_a_zero_bubble_pipeline_is_named_by_every_stage() -> None:
    survivors = _run(4, 4, Die(1, "forward", how="raise"), schedule="zb_h1")
    for o in survivors:
        line = _last_line(o)
        assert "rank 1 (dp_rank 0, pp_rank 1, tp_rank 0) raised ValueError: a bug on rank 1" in line, line
        assert "rendezvous store is unreachable" not in (o.error or ""), o.error
        assert "one of ranks" not in (o.error or ""), o.error
