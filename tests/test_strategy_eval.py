"""validate / test / predict and the callbacks that read callback_metrics, under pipe_tp (pp=2).

One fit with ModelCheckpoint(monitor="val_loss", save_top_k=2), EarlyStopping, LearningRateMonitor
and a CSV logger, then trainer.validate / test / predict on the trained model; every number is
compared with the same sequence on one device. ModelCheckpoint must keep and delete the same
checkpoints (sharded directories here, files there), and the best one, consolidated, must hold the
single device's best weights.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint, is_checkpoint_directory
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
TRAIN, VAL, TEST = dataset(40, seed=1), dataset(16, seed=2), dataset(12, seed=3)


def _load_state(path: str) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint: a single-device file, or a pipe_tp sharded directory."""
    if os.path.isdir(path):
        return consolidate_checkpoint(path)["state_dict"]
    return torch.load(path, weights_only=True)["state_dict"]


def _listing(directory: str) -> list[tuple[str, str]]:
    """Checkpoint names and kinds: pipe_tp's are complete sharded directories, one device's files."""
    return [
        (name, "sharded" if is_checkpoint_directory(os.path.join(directory, name)) else "file")
        for name in sorted(os.listdir(directory))
    ]


def _session(strategy: Any, devices: int, reference: bool) -> dict[str, Any]:
    model = Regressor(lr=0.02)
    with tempfile.TemporaryDirectory() as root:
        checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), monitor="val_loss", save_top_k=2)
        stopper = EarlyStopping(monitor="val_loss", min_delta=0.005, patience=1)
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_epochs=6,
            callbacks=[checkpoint, stopper, LearningRateMonitor()],
            logger=CSVLogger(root),
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(model, loader(TRAIN, 8, reference), loader(VAL, 8, reference))
        best = None
        if trainer.is_global_zero:
            best = _load_state(checkpoint.best_model_path)
        out = {
            "epochs": trainer.current_epoch,
            "stopped_epoch": stopper.stopped_epoch,
            "best_score": float(checkpoint.best_model_score),
            "kept": sorted(os.path.basename(p) for p in checkpoint.best_k_models),
            "files": _listing(os.path.join(root, "ckpt")) if trainer.is_global_zero else None,
            "best_state": best,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "validate": trainer.validate(model, loader(VAL, 8, reference), verbose=False),
            "test": trainer.test(model, DataLoader(TEST, batch_size=6), verbose=False),
            "predict": trainer.predict(model, DataLoader(TEST, batch_size=5)),
        }
        # Spoil the weights, then validate from the best checkpoint (a sharded directory under pipe_tp).
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        val = loader(VAL, 8, reference)
        out["validate_spoiled"] = trainer.validate(model, val, verbose=False)
        out["validate_best"] = trainer.validate(model, val, ckpt_path="best", verbose=False)
    return out


def eval_worker() -> dict[str, Any]:
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    out = _session(strategy, 2, reference=False)
    # The same module, unchanged, also trains under plain DDP (configure_pipeline is ignored there).
    model = Regressor()
    trainer = fit(model, "ddp", 2, loader(TRAIN, 8, reference=False), max_epochs=1)
    out["ddp_loss"] = float(trainer.callback_metrics["train_loss_epoch"])
    out["ddp_weight"] = model.layers[0].weight.detach().clone()
    return out


@pytest.fixture(scope="module")
def sessions() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    got = run_distributed(eval_worker, 2, timeout=400, init_group=False)
    return got, _session("auto", 1, reference=True)


def test_callbacks_see_single_device_metrics(sessions: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    got, ref = sessions
    for r in got:
        assert r["epochs"] == ref["epochs"]
        assert r["stopped_epoch"] == ref["stopped_epoch"]
        assert r["best_score"] == pytest.approx(ref["best_score"], abs=TOL)
        assert r["kept"] == ref["kept"]
        assert r["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, abs=TOL), key
    # The run must actually have stopped early, or the EarlyStopping check above proves nothing.
    assert 0 < ref["stopped_epoch"] < 5
    # Three epochs saved three checkpoints; save_top_k=2 must have deleted the worst one.
    assert ref["epochs"] >= 3
    # ... and kept the same two, as complete sharded directories (no temporary ones left behind).
    assert [name for name, _ in got[0]["files"]] == [name for name, _ in ref["files"]]
    assert [kind for _, kind in got[0]["files"]] == ["sharded", "sharded"]
    assert [kind for _, kind in ref["files"]] == ["file", "file"]


def test_validate_from_the_best_checkpoint(sessions: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    got, ref = sessions
    # The best epoch's weights, reloaded over spoiled ones, score what ModelCheckpoint recorded...
    assert ref["validate_spoiled"][0]["val_loss"] != pytest.approx(ref["best_score"], abs=1e-2)
    assert ref["validate_best"][0]["val_loss"] == pytest.approx(ref["best_score"], abs=TOL)
    for r in got:  # ... and so they do under pipe_tp, read back from the sharded directory.
        assert r["validate_spoiled"][0]["val_loss"] == pytest.approx(
            ref["validate_spoiled"][0]["val_loss"], abs=TOL
        )
        assert r["validate_best"][0]["val_loss"] == pytest.approx(ref["best_score"], abs=TOL)


def test_best_checkpoint_holds_every_stage(sessions: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    got, ref = sessions
    saved, expected = got[0]["best_state"], ref["best_state"]
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=TOL, rtol=0, msg=key)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_results(sessions: tuple[list[dict[str, Any]], dict[str, Any]], stage: str) -> None:
    got, ref = sessions
    for r in got:
        assert len(r[stage]) == len(ref[stage]) == 1
        assert r[stage][0].keys() == ref[stage][0].keys()
        for key, value in ref[stage][0].items():
            assert r[stage][0][key] == pytest.approx(value, abs=TOL), key


def test_predict_returns_replica_predictions_on_every_rank(
    sessions: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    got, ref = sessions
    for r in got:
        assert len(r["predict"]) == len(ref["predict"]) == 3
        for mine, theirs in zip(r["predict"], ref["predict"], strict=True):
            torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0)


def test_same_module_trains_under_ddp(sessions: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    got, _ = sessions
    assert torch.isfinite(torch.tensor(got[0]["ddp_loss"]))
    torch.testing.assert_close(got[0]["ddp_weight"], got[1]["ddp_weight"], atol=0, rtol=0)
    assert not torch.equal(got[0]["ddp_weight"], Regressor().layers[0].weight.detach())
