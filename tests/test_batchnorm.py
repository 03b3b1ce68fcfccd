"""BatchNorm under micro-batching: running statistics equal one device's (deferred batch norm).

With the learning rate at zero the weights never move, so the input of the BatchNorm layer is the
same as on one device and its running mean, running variance and ``num_batches_tracked``
after several steps must match one device's to 1e-5, with activation recomputation (whose
recomputed forwards must not count twice) and with data-parallel replicas (whose statistics one
device would have seen as one batch). Evaluation then uses those statistics, so the validation
loss matches too. ``deferred_batch_norm=False`` restores per-micro-batch updates.

Training normalises each micro-batch by its own statistics, another model than one device's, so
``fit`` refuses a pipeline holding a BatchNorm under several micro-batches unless the user chose
(``num_microbatches=1``, or ``allow_batch_norm_microbatches=True``, which these statistics tests
pass); evaluation alone is not refused.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe import PipeTPStrategy
from lightning_pipe.execution.batchnorm import DeferredBatchNorm
from tests.distributed import run_distributed
from tests.lightning_models import HIDDEN, IN, OUT, Regressor, dataset, loader
from tests.trainers import fit

TOL = 1e-5
TRAIN, VAL = dataset(48, seed=1), dataset(16, seed=2)
STATS = ("running_mean", "running_var", "num_batches_tracked")


class BatchNormNet(Regressor):
    def __init__(self, lr: float = 0.0) -> None:
        super().__init__(lr=lr, step_lr=False)
        torch.manual_seed(0)
        # One BatchNorm, on the second stage: a BatchNorm after another one would see inputs
        # normalised with micro-batch statistics, which no schedule can make equal.
        self.layers = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
            nn.BatchNorm1d(HIDDEN, momentum=None), nn.Tanh(), nn.Linear(HIDDEN, OUT),
        )  # fmt: skip


def _fit_and_validate(strategy: Any, devices: int, reference: bool, batch_size: int = 12) -> dict[str, Any]:
    model = BatchNormNet()
    with tempfile.TemporaryDirectory() as root:
        data = loader(TRAIN, batch_size, reference)
        trainer = fit(model, strategy, devices, data, root, max_epochs=1, num_sanity_val_steps=0)
        # sync_dist: with data parallelism each replica validates half of the data.
        val = trainer.validate(model, loader(VAL, 8, reference), verbose=False)[0]["val_loss_synced"]
    buffers = {n: b.clone() for n, b in model.named_buffers() if n.endswith(STATS)}
    return {"buffers": buffers, "val_loss": val}


def bn_worker(pp: int, dp: int, checkpoint: str, deferred: bool) -> dict[str, Any]:
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        num_microbatches=3,
        recompute=checkpoint,
        deferred_batch_norm=deferred,
        allow_batch_norm_microbatches=True,  # the statistics are compared, at a learning rate of 0
        timeout=timedelta(seconds=60),
    )
    result = _fit_and_validate(strategy, pp * dp, reference=False, batch_size=12 // dp)
    plan = strategy.runtime.partition
    assert plan is not None
    result["owned"] = {n for n in result["buffers"] if plan.stage_of_key(n) == strategy.pp_rank}
    return result


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("pp", "dp", "checkpoint"), [(2, 1, "always"), (1, 2, "never")], ids=["pp2-recompute", "dp2"]
)
def test_running_statistics_match_one_device(pp: int, dp: int, checkpoint: str) -> None:
    got = run_distributed(bn_worker, pp * dp, pp, dp, checkpoint, True, timeout=200, init_group=False)
    # dp=2 sees batches of 6 per replica, 12 together: the reference sees the batches of 12.
    ref = _fit_and_validate("auto", 1, reference=True)
    assert ref["buffers"]["layers.3.num_batches_tracked"] == 4
    seen = set()
    for rank, result in enumerate(got):
        assert result["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL), f"rank {rank}"
        for name in result["owned"]:
            seen.add(name)
            torch.testing.assert_close(
                result["buffers"][name].double(), ref["buffers"][name].double(), atol=TOL, rtol=0, msg=name
            )
    assert seen == set(ref["buffers"])


@pytest.mark.distributed
def test_without_deferral_statistics_update_per_micro_batch() -> None:
    got = run_distributed(bn_worker, 1, 1, 1, "never", False, timeout=120, init_group=False)
    assert got[0]["buffers"]["layers.3.num_batches_tracked"] == 4 * 3


def test_deferred_statistics_of_micro_batches_equal_the_whole_batch() -> None:
    """No processes: three micro-batches through deferred BatchNorm2d, one commit, against one
    BatchNorm2d forward of the whole batch."""
    torch.manual_seed(0)
    whole, parts = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
    batch = torch.randn(9, 4, 3, 3) * 3 + 1
    whole(batch)
    deferred = DeferredBatchNorm([parts])
    deferred.begin()
    outputs = [parts(x) for x in batch.split([4, 3, 2])]
    deferred.commit()
    # Each micro-batch is normalised with its own statistics, as a training-mode BatchNorm does.
    torch.testing.assert_close(outputs[2], nn.functional.batch_norm(batch[7:], None, None, training=True))
    for name in STATS:
        torch.testing.assert_close(getattr(parts, name), getattr(whole, name), atol=1e-6, rtol=0)
    deferred.remove()
    parts(batch)  # hooks removed: an ordinary BatchNorm again
    assert int(parts.num_batches_tracked) == 2


class BatchNormFirst(BatchNormNet):
    """The BatchNorm on the first stage instead of the second."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(), nn.Linear(HIDDEN, OUT),
        )  # fmt: skip


def warning_worker(first: bool, dp: int, microbatches: int) -> list[str]:
    import warnings

    model = BatchNormFirst() if first else BatchNormNet()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, data_parallel_size=dp, num_microbatches=microbatches,
        allow_batch_norm_microbatches=microbatches != 1, timeout=timedelta(seconds=60),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory() as root:
        warnings.simplefilter("always")
        fit(model, strategy, 2 * dp, loader(TRAIN, 8, False), root, max_steps=1)
    return [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("first", "dp", "microbatches"),
    [(False, 1, 4), (True, 1, 2), (True, 2, 2), (False, 1, 1)],
    ids=["pp2-last-stage", "pp2-first-stage", "dp2xpp2", "one-micro-batch"],
)
def test_every_pipeline_allowed_to_hold_a_batch_norm_warns_with_the_size_and_the_fixes(
    first: bool, dp: int, microbatches: int
) -> None:
    got = run_distributed(warning_worker, 2 * dp, first, dp, microbatches, init_group=False, timeout=150)
    rank0 = got[0]
    assert all(r == [] for r in got[1:]), got  # rank 0 warns for the job
    if microbatches == 1:  # one micro-batch normalises by the whole batch's statistics: exact
        assert rank0 == [], rank0
        return
    (text,) = rank0
    name = "layers.1" if first else "layers.3"
    assert f"the model holds BatchNorm layers ({name})" in text, text
    assert "losses up to 0.6 apart" in text and "running_var up to 25 apart" in text  # the size
    for fix in ("num_microbatches=1", "LayerNorm, GroupNorm", "eval mode with frozen statistics"):
        assert fix in text, text


def refusal_worker() -> dict[str, Any]:
    """``fit`` at pp=2 with two micro-batches and no choice made: the error; then ``validate`` of
    the same kind of model, which evaluates with running statistics, as one device does."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from tests.trainers import quiet_trainer

    def strategy() -> PipeTPStrategy:
        return PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))

    result: dict[str, Any] = {}
    model = BatchNormNet(lr=0.1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as root:
        try:
            fit(model, strategy(), 2, loader(TRAIN, 8, False), root, max_steps=2)
        except MisconfigurationException as err:
            result["error"] = str(err)
        result["untouched"] = all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
        trainer = quiet_trainer(strategy(), 2, root)
        result["validated"] = trainer.validate(BatchNormNet(), loader(VAL, 8, False), verbose=False)
        # Frozen statistics (the BatchNorm in eval mode, which Lightning keeps): each micro-batch
        # is normalised by the running statistics, exactly as one device: it trains.
        frozen = BatchNormNet(lr=0.1)
        for m in frozen.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.eval()
        before = {k: v.clone() for k, v in frozen.state_dict().items()}
        fit(frozen, strategy(), 2, loader(TRAIN, 8, False), root, max_steps=2)
        after = frozen.state_dict()
        result["frozen_trained"] = any(not torch.equal(v, after[k]) for k, v in before.items())
        result["frozen_statistics_kept"] = all(
            torch.equal(v, after[k]) for k, v in before.items() if "running" in k or "num_batches" in k
        )
    return result


@pytest.mark.distributed
def test_batch_norm_under_several_micro_batches_is_refused_at_setup_unless_chosen() -> None:
    """Issue 41, item 6: a BatchNorm normalising each micro-batch by its own statistics trains
    another model than one device (losses up to 0.89 apart): ``fit`` stops before any step, with
    the size of the difference and the three choices; evaluation alone is not refused."""
    got = run_distributed(refusal_worker, 2, init_group=False, timeout=150)
    for rank, result in enumerate(got):
        text = result.get("error")
        assert text is not None, f"rank {rank} trained"
        assert "the model holds BatchNorm layers (layers.3) and num_microbatches=2" in text, text
        assert "losses up to 0.6 apart" in text and "up to 0.89 apart" in text and "running_var" in text
        for fix in ("num_microbatches=1", "GroupNorm, LayerNorm", "allow_batch_norm_microbatches=True"):
            assert fix in text, text
        assert result["untouched"], f"rank {rank}: a step ran before the refusal"
        assert len(result["validated"]) == 1 and "val_loss" in result["validated"][0], result["validated"]
        assert result["frozen_trained"] and result["frozen_statistics_kept"], result
