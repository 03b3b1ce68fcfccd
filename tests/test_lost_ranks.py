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
import time
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy
from tests.distributed import Outcome, run_distributed_outcomes
from tests.gpt_models import token_data
from tests.lightning_models import Regressor, dataset, loader
from tests.test_sequence_parallel import SequenceGPT
from tests.trainers import fit

pytestmark = pytest.mark.distributed

DATA = dataset(64, seed=1)
VANISHED = "vanished without an error of its own"


class Die(L.Callback):
    """Rank ``rank`` ends at step 2: SIGKILL (``how="kill"``), SIGTERM (``"term"``) or a ValueError,
    in the forward of its stage's first layer (``layer``: a later one; before the layer's own
    hooks, such as FSDP2's all-gather), in the optimizer step, or while a checkpoint is saved."""

    def __init__(self, rank: int, where: str, how: str = "kill", layer: int = 0) -> None:
        self.rank, self.where, self.how, self.layer = rank, where, how, layer

    def _die(self) -> None:
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the signal watcher ends the process
        raise ValueError(f"a bug on rank {self.rank}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        if self.where == "forward":
            layer = runtime.layers[runtime.partition.layer_range(runtime.stage_indices[0])[self.layer]]
            layer.register_forward_pre_hook(
                lambda *_: self._die() if trainer.global_step == 2 else None, prepend=True
            )
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
    options = dict(options)
    if options.pop("model", None) == "sequence_gpt":  # a tiny GPT with a sequence-parallel plan
        model: L.LightningModule = SequenceGPT()
        data = DataLoader(token_data(32), batch_size=8)
    else:
        model, data = Regressor(), loader(DATA, 8, reference=False)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, num_microbatches=4, timeout=timedelta(seconds=60), **options
    )
    fit(model, strategy, devices, data, root, max_steps=4, callbacks=[die])


EXIT = {"kill": -signal.SIGKILL, "term": 128 + signal.SIGTERM, "raise": 1}


def _launch(devices: int, pp: int, die: Die, **options: Any) -> tuple[Outcome, list[Outcome]]:
    """The target's outcome and the survivors'."""
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(
            worker, devices, root, devices, pp, die, options, timeout=150, init_group=False
        )
    target = outcomes[die.rank]
    assert target.exitcode == EXIT[die.how], outcomes
    for o in outcomes:
        assert not o.killed, f"rank {o.rank} hung"
    return target, [o for o in outcomes if o.rank != die.rank]


def _run(devices: int, pp: int, die: Die, **options: Any) -> list[Outcome]:
    return _launch(devices, pp, die, **options)[1]


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


LIMIT_S = 10.0
"""From a rank's end to the last survivor's exit (the harness sees each exit within 50 ms)."""


def _named_by_every_survivor(target: Outcome, survivors: list[Outcome], lost: str) -> None:
    """Each survivor ends with the project's error naming ``lost`` (never the transport's bare
    words, never the store's host while it is alive), within :data:`LIMIT_S` of the fault."""
    for o in survivors:
        line = _last_line(o)
        assert o.exitcode == 1, o
        assert "PeerLostError: " in line or "PipelineCommunicationError: " in line, (
            o.rank,
            (o.error or "")[-3000:],
        )
        assert lost in line, (o.rank, line)
        assert "closed by peer" not in line.split("(Underlying error")[0], (o.rank, line)
        assert "the process that hosts it, has stopped" not in (o.error or ""), (o.rank, line)
        took = o.seconds - target.seconds
        assert took <= LIMIT_S, f"rank {o.rank} ended {took:.1f}s after the fault: {line}"


def test_a_tensor_rank_killed_under_sequence_parallelism_is_named_by_every_survivor() -> None:
    """pp=2 x tp=2: rank 1 (pp_rank 0, tp_rank 1) is killed before its first block, while its
    tensor peer, rank 0, all-gathers the sequence for that block; the next stage waits for them."""
    target, survivors = _launch(
        4, 2, Die(1, "forward", layer=1), model="sequence_gpt", tensor_parallel_size=2, sequence_parallel=True
    )
    lost = f"rank 1 (dp_rank 0, pp_rank 0, tp_rank 1) {VANISHED}"
    _named_by_every_survivor(target, survivors, lost)
    peer = _last_line(survivors[0])
    assert (
        "PeerLostError: rank 0 (dp_rank 0, pp_rank 0, tp_rank 0) stopped while all-gathering the sequence "
        f"over the tensor-parallel group (forward): {lost}" in peer
    ), peer


@pytest.mark.parametrize("how", ["term", "kill"])
def test_a_rank_lost_inside_fsdp2_gathers_is_named_by_every_survivor(how: str) -> None:
    """dp=2 x pp=2 under FSDP2: rank 2 (dp_rank 1, pp_rank 0) receives SIGTERM, or is killed, just
    before a layer's forward (before FSDP2's all-gather of its parameters), while its data-parallel
    peer, rank 0, all-gathers them; rank 3 waits for its activations, rank 1 for rank 0's."""
    options: dict[str, Any] = {"shard_parameters": True}
    if how == "kill":  # each layer gathered at its own forward: rank 2 dies at the second Linear
        options["reshard_after_forward"] = True
    target, survivors = _launch(4, 2, Die(2, "forward", how=how, layer=2 if how == "kill" else 0), **options)
    who = "rank 2 (dp_rank 1, pp_rank 0, tp_rank 0)"
    lost = f"{who} received SIGTERM" if how == "term" else f"{who} {VANISHED}"
    _named_by_every_survivor(target, survivors, lost)
    peer = _last_line(survivors[0])
    assert (
        "PeerLostError: rank 0 (dp_rank 0, pp_rank 0, tp_rank 0) stopped while all-gathering parameters over "
        "the data-parallel group (FSDP2): " in peer
    ), peer
