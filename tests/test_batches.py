"""Batches under pipe_tp as users feed them:

* ranks of one pipeline that load different data (an IterableDataset sharded by *global* rank)
  stop at the first step, every rank with a message naming the step, the ranks and the fix;
  sharded by ``strategy.data_parallel_rank`` instead, dp=2 x pp=2 equals one device;
* a last batch smaller than ``num_microbatches`` runs with fewer micro-batches and still equals
  one device;
* ``training_step`` returning ``None`` stops with a message that says what to do instead.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from lightning_pipe import PipeTPStrategy
from tests.distributed import Outcome, run_distributed, run_distributed_outcomes
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit, quiet_trainer

pytestmark = pytest.mark.distributed

TOL = 1e-5
TRAIN = dataset(32, seed=1)


class Strided(IterableDataset):
    """Every ``size``-th sample from ``rank`` on: how a stream is sharded over processes."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __iter__(self) -> Any:
        for i in range(self.rank, len(TRAIN), self.size):
            yield TRAIN[i]


class GlobalRankSharded(Regressor):
    """The common mistake: shard the stream by the global rank (as webdataset or
    ``split_dataset_by_node(rank=RANK)`` would), so the two stages of one pipeline differ."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Strided(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])), batch_size=4)


class ReplicaSharded(Regressor):
    """The documented way: shard by the data-parallel rank and size."""

    def train_dataloader(self) -> DataLoader:
        s = self.trainer.strategy
        return DataLoader(Strided(s.data_parallel_rank, s.data_parallel_world_size), batch_size=4)  # type: ignore[attr-defined]


def _owned(model: L.LightningModule, strategy: PipeTPStrategy) -> dict[str, torch.Tensor]:
    """The parameters this rank's stage trains (the others stay as built)."""
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank  # type: ignore[union-attr]
    }


def _assert_owned_equal(got: list[dict[str, torch.Tensor]], reference: L.LightningModule) -> None:
    expected = dict(reference.named_parameters())
    assert {n for params in got for n in params} == set(expected)
    for rank, params in enumerate(got):
        for name, value in params.items():
            torch.testing.assert_close(
                value, expected[name].detach(), atol=TOL, rtol=0, msg=f"rank {rank} {name}"
            )


def _two_stage_fit(model: L.LightningModule, root: str) -> None:
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    fit(model, strategy, 2, root=root, max_epochs=1)


def _both_fail(worker: Any) -> list[Outcome]:
    """Run ``worker`` on two ranks, each of which must exit 1 with an error (not be killed)."""
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(worker, 2, root, timeout=120, init_group=False)
    for o in outcomes:
        assert o.exitcode == 1 and not o.killed and o.error is not None, o
    return outcomes


def mismatch_worker(root: str) -> None:
    _two_stage_fit(GlobalRankSharded(), root)


def test_pipeline_ranks_with_different_data_stop_at_the_first_step() -> None:
    outcomes = _both_fail(mismatch_worker)
    for o in outcomes:
        assert o.error is not None
        assert "StepCheckError: pipe_tp: the ranks of one model replica must run the same batch" in o.error
        assert "at training_step of batch 0 they do not. The ranks loaded different data" in o.error
        assert "ranks [0] (pp_rank 0, tp_rank 0): training_step of batch 0, shapes" in o.error
        assert "ranks [1] (pp_rank 1, tp_rank 0)" in o.error
        assert "Shard the data by the data-parallel rank and size" in o.error
    # Both ranks stop together, long before the 60 s exchange deadline.
    assert max(o.seconds for o in outcomes) - min(o.seconds for o in outcomes) < 10


def replica_worker(root: str) -> dict[str, torch.Tensor]:
    model = ReplicaSharded(step_lr=False)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60)
    )
    fit(model, strategy, 4, root=root, max_epochs=2)
    return _owned(model, strategy)


def test_data_sharded_by_data_parallel_rank_matches_one_device() -> None:
    """dp=2 x pp=2: replica r streams samples r, r+2, ... in batches of 4, so each global batch
    of 8 holds the same samples as one device's batch of 8."""
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(replica_worker, 4, root, timeout=200, init_group=False)
        reference = Regressor(step_lr=False)
        fit(reference, "auto", 1, DataLoader(TRAIN, batch_size=8), root, max_epochs=2)
    _assert_owned_equal(got, reference)


RAGGED = dataset(20, seed=3)  # batches of 8, 8 and 4


def ragged_worker(root: str) -> dict[str, torch.Tensor]:
    model = Regressor()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=6, timeout=timedelta(seconds=60))
    fit(model, strategy, 2, loader(RAGGED, 8, reference=False), root, max_epochs=2)
    return _owned(model, strategy)


def test_a_last_batch_smaller_than_num_microbatches_matches_one_device() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(ragged_worker, 2, root, timeout=200, init_group=False)
        reference = Regressor()
        fit(reference, "auto", 1, loader(RAGGED, 8, reference=True), root, max_epochs=2)
    _assert_owned_equal(got, reference)


class SkipsBatchOne(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def none_worker(root: str) -> None:
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    fit(SkipsBatchOne(), strategy, 2, loader(TRAIN, 8, reference=False), root, max_epochs=1)


def test_training_step_returning_none_says_what_to_do() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(none_worker, 2, root, timeout=120, init_group=False)
    assert all(o.exitcode == 1 and not o.killed for o in outcomes), outcomes
    last = outcomes[1].error or ""
    assert "training_step returned None for micro-batch 0 of batch 1 (to skip the batch" in last
    assert "drop such samples before they reach the model" in last
    assert "return a zero loss (`return loss * 0.0`" in last
    # The first stage does not wait for the exchange deadline: it learns that its peer stopped.
    assert max(o.seconds for o in outcomes) < 50


class ShortStream(IterableDataset):
    """Every ``size``-th sample from ``rank`` on, among the first ``stop`` samples."""

    def __init__(self, rank: int, size: int, stop: int) -> None:
        self.rank, self.size, self.stop = rank, size, stop

    def __iter__(self) -> Any:
        for i in range(self.rank, self.stop, self.size):
            yield TRAIN[i]


class UnevenReplicas(Regressor):
    """Replica 1 streams 12 samples (3 batches), replica 0 all 16 of its own (4 batches); a stream
    has no length, so the end is only learnt by running out. The module logs epoch-level metrics
    (a collective at the end of the epoch on every rank)."""

    def train_dataloader(self) -> DataLoader:
        s = self.trainer.strategy
        stop = len(TRAIN) if s.data_parallel_rank == 0 else 24  # type: ignore[attr-defined]
        return DataLoader(ShortStream(s.data_parallel_rank, 2, stop), batch_size=4)  # type: ignore[attr-defined]


class UnevenSizedReplicas(Regressor):
    """The same data as :class:`UnevenReplicas`, as lists with a length (4 batches and 3)."""

    def train_dataloader(self) -> DataLoader:
        s = self.trainer.strategy
        stop = len(TRAIN) if s.data_parallel_rank == 0 else 24  # type: ignore[attr-defined]
        return DataLoader(list(ShortStream(s.data_parallel_rank, 2, stop)), batch_size=4)  # type: ignore[attr-defined]


def uneven_worker(root: str, sized: bool) -> tuple[dict[str, torch.Tensor], list[str], int]:
    model = UnevenSizedReplicas(step_lr=False) if sized else UnevenReplicas(step_lr=False)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60)
    )
    trainer = quiet_trainer(strategy, 4, root, max_epochs=2, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return _owned(model, strategy), [str(w.message) for w in caught], trainer.global_step


@pytest.mark.parametrize("sized", [False, True], ids=["stream", "sized"])
def test_replicas_with_unequal_batch_counts_stop_together_at_the_shorter(sized: bool) -> None:
    """dp=2 x pp=2, replica 1 one batch short: every rank ends each epoch after 3 steps, rank 0
    says which replica's batches were skipped, and the weights equal one device trained on the
    samples both replicas had (the first 24, in batches of 8)."""
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(uneven_worker, 4, root, sized, timeout=200, init_group=False)
        reference = Regressor(step_lr=False)
        both_had = DataLoader(Subset(TRAIN, range(24)), batch_size=8)
        fit(reference, "auto", 1, both_had, root, max_epochs=2)
    _assert_owned_equal([owned for owned, _, _ in results], reference)
    assert [steps for _, _, steps in results] == [6, 6, 6, 6]
    expected = (
        "pipe_tp: data-parallel replicas [1] have no more train batches after 3 while replicas [0] "
        "have more: every rank stops this loop after 3 train batches and the remaining train batches "
        "of replicas [0] are skipped."
    )
    assert any(expected in m for m in results[0][1]), results[0][1]
    assert not any("have no more" in m for _, caught, _ in results[1:] for m in caught)


class ShortOnLastStage(Regressor):
    """The same samples on both stages, but the last stage's stream stops one batch early."""

    def train_dataloader(self) -> DataLoader:
        stop = 24 if self.trainer.strategy.holds_last_stage else len(TRAIN)  # type: ignore[attr-defined]
        return DataLoader(ShortStream(0, 1, stop), batch_size=8)


def short_stage_worker(root: str) -> None:
    _two_stage_fit(ShortOnLastStage(), root)


def test_pipeline_ranks_with_unequal_batch_counts_stop_with_the_fix() -> None:
    outcomes = _both_fail(short_stage_worker)
    for o in outcomes:
        assert o.error is not None
        assert (
            "StepCheckError: pipe_tp: the ranks of one model replica must load the same train batches, "
            "but the train batches of replica dp_rank 0 end at different points (after 3 of them):"
        ) in o.error
        assert "ranks [0] (dp_rank 0, pp_rank 0, tp_rank 0): has another" in o.error
        assert "ranks [1] (dp_rank 0, pp_rank 1, tp_rank 0): has no more" in o.error
        assert "Shard the data by the data-parallel rank and size" in o.error
    assert max(o.seconds for o in outcomes) < 50
