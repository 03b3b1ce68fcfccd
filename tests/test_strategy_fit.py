"""``Trainer.fit`` under pipe_tp (gloo, CPU) ends where ``strategy="auto"`` on one device ends.

Weights after two epochs (within 1e-5), ``callback_metrics`` (loss on step and epoch, a
torchmetrics metric, a ``sync_dist`` value), identical on every rank and equal to the single
device, for pp in {2, 4}, both schedules, accumulate_grad_batches in {1, 2}, with and without
gradient clipping, with a per-step LR scheduler. Several fits share one spawned world per pipeline
size to keep CI fast.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
TRAIN, VAL = dataset(40, seed=1), dataset(16, seed=2)

CASES = [
    {"id": "1f1b-acc1", "schedule": "1f1b", "m": 4, "acc": 1, "clip": None},
    {"id": "gpipe-acc2-clip", "schedule": "gpipe", "m": 3, "acc": 2, "clip": 0.05},
    {"id": "1f1b-acc2-clip", "schedule": "1f1b", "m": 2, "acc": 2, "clip": 0.05},
    {"id": "gpipe-acc1-m8", "schedule": "gpipe", "m": 8, "acc": 1, "clip": None},
]


def _settings(case: dict[str, Any]) -> dict[str, Any]:
    """The case's Trainer settings, the same under pipe_tp and on one device."""
    return {"max_epochs": 2, "accumulate_grad_batches": case["acc"], "gradient_clip_val": case["clip"]}


def _metrics(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def fit_worker(pp: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for case in cases:
        model = Regressor()
        strategy = PipeTPStrategy(
            pipeline_parallel_size=pp,
            num_microbatches=case["m"],
            schedule=case["schedule"],
            timeout=timedelta(seconds=60),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train, val = loader(TRAIN, 8, reference=False), loader(VAL, 8, reference=False)
            trainer = fit(model, strategy, pp, train, val=val, **_settings(case))
        # One replica: every rank logs the same values, and Lightning must not ask for sync_dist.
        asked = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
        owned = {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank
        }
        out[case["id"]] = {
            "params": owned, "metrics": _metrics(trainer), "step": trainer.global_step, "asked": asked
        }  # fmt: skip
    return out


def reference(case: dict[str, Any]) -> dict[str, Any]:
    model = Regressor()
    train, val = loader(TRAIN, 8, reference=True), loader(VAL, 8, reference=True)
    trainer = fit(model, "auto", 1, train, val=val, **_settings(case))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "metrics": _metrics(trainer), "step": trainer.global_step}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"pp{p}")
def fits(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_distributed(fit_worker, request.param, request.param, CASES, timeout=400, init_group=False)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_fit_matches_single_device(fits: list[dict[str, Any]], case: dict[str, Any]) -> None:
    ref = reference(case)
    got = [r[case["id"]] for r in fits]
    merged = {n: p for r in got for n, p in r["params"].items()}
    assert merged.keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        torch.testing.assert_close(merged[name], expected, atol=TOL, rtol=0, msg=f"weight {name}")
    for rank, r in enumerate(got):
        assert r["asked"] == [], f"rank {rank}"
        assert r["step"] == ref["step"]
        assert r["metrics"].keys() == ref["metrics"].keys(), f"rank {rank}"
        for key, value in ref["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, abs=TOL), f"rank {rank}: {key}"
    # Identical on every rank, not merely close.
    assert all(r["metrics"] == got[0]["metrics"] for r in got)


def dp_worker() -> dict[str, Any]:
    model = Regressor()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    case = {"acc": 2, "clip": 0.05}
    fit(model, strategy, 4, loader(TRAIN, 4, reference=False), **_settings(case))
    coords = strategy.mesh.coordinates
    return {
        "coords": (coords.dp_rank, coords.pp_rank),
        "params": {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank
        },
    }


def test_data_parallel_pipelines_match_one_device_on_the_whole_batch() -> None:
    """dp=2 x pp=2: each replica sees half of every batch of 8; one device sees all 8."""
    got = run_distributed(dp_worker, 4, timeout=300, init_group=False)
    assert [r["coords"] for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    model = Regressor()
    fit(model, "auto", 1, loader(TRAIN, 8, reference=True), **_settings({"acc": 2, "clip": 0.05}))
    for replica in (got[:2], got[2:]):
        merged = {n: p for r in replica for n, p in r["params"].items()}
        for name, expected in model.named_parameters():
            torch.testing.assert_close(merged[name], expected.detach(), atol=TOL, rtol=0, msg=name)
