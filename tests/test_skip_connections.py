"""Skip connections across stages train to one device's numbers: the example U-Net (its down
path stashes, its up path pops; ``forward`` written with its skips) and the example
encoder-decoder (every decoder layer pops the encoder's output, one stash popped on every later
stage), at pp=2 and pp=4 under GPipe, 1F1B, interleaved 1F1B and ZB-H1, with recomputation, with
tensor parallelism (tp=2) and data parallelism (dp=2), on batches of two sizes (20 samples in
batches of 8: the last is 4), then validate and predict on the same Trainer, and a checkpoint saved
with skips resumed at another layout.

Every case compares the whole model (gathered on rank 0) after two epochs, and every step's loss,
with ``strategy="auto"`` on one process within 1e-5.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from tests.distributed import run_distributed
from tests.lightning_models import loader
from tests.test_skip_schedules import load_example
from tests.trainers import fit, quiet_trainer

pytestmark = pytest.mark.distributed

TOL = 1e-5
SAMPLES, BATCH, EPOCHS = 20, 8, 2


class Losses(L.Callback):
    """Every training step's loss, as the Trainer logged it."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def _model(name: str) -> tuple[L.LightningModule, Any]:
    models: Any = load_example()
    if name == "unet":
        return models.UNet(), models.shapes_dataset(SAMPLES)
    return models.Seq2Seq(), models.reversal_dataset(SAMPLES)


def worker(
    name: str,
    pp: int,
    schedule: str,
    m: int,
    recompute: str,
    tp: int = 1,
    dp: int = 1,
    v: int = 1,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    model, data = _model(name)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, schedule=schedule, virtual_stages=v,
        num_microbatches=m, recompute=recompute, timeout=timedelta(seconds=90), **(options or {}),
    )  # fmt: skip
    losses = Losses()
    fit(
        model, strategy, int(os.environ["WORLD_SIZE"]), loader(data, BATCH // dp, reference=False),
        max_epochs=EPOCHS, accumulate_grad_batches=dp, callbacks=[losses],
    )  # fmt: skip
    runtime = strategy.runtime
    return {
        "state": gather_model_state(model, runtime.partition, strategy.mesh),
        "losses": losses.values,
        "routes": [(r.producer, r.consumer, r.names) for r in runtime.skip_routes],
        "layout": runtime.describe(),
        "kinds": sorted({type(m).__name__ for m in model.modules() if "Parallel" in type(m).__name__}),
    }


@functools.cache
def reference(name: str, dp: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process; with ``dp`` replicas of batches of ``BATCH / dp`` accumulating ``dp`` batches,
    the reference takes whole batches and accumulates as many (the same samples per step). Trained
    once per model and ``dp`` (the models are seeded): the cases compare with it, never change it."""
    model, data = _model(name)
    losses = Losses()
    fit(
        model, "auto", 1, loader(data, BATCH, reference=True), max_epochs=EPOCHS,
        accumulate_grad_batches=dp, callbacks=[losses],
    )  # fmt: skip
    return model.state_dict(), losses.values


def _assert_matches(got: list[dict[str, Any]], name: str, dp: int = 1) -> None:
    expected, losses = reference(name, dp)
    state = got[0]["state"]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=key)
    for rank, result in enumerate(got):
        if dp == 1:  # under accumulation the logged value is the last batch's share
            assert result["losses"] == pytest.approx(losses, abs=TOL), f"rank {rank}"
        assert result["routes"], "the partition puts the skips' ends on different stages"
        a, c, names = result["routes"][0]
        assert f"skip connections sent between stages: {a} -> {c} ({', '.join(names)})" in result["layout"]


CASES = [
    pytest.param(name, pp, schedule, m, recompute, v, id=f"{name}-pp{pp}-{schedule}-m{m}-{recompute}")
    for name in ("unet", "seq2seq")
    for pp, schedule, m, recompute, v in (
        (2, "gpipe", 2, "always", 1),
        (2, "1f1b", 4, "never", 1),
        (2, "interleaved_1f1b", 4, "except_last", 2),
        (2, "zb_h1", 2, "always", 1),
        (4, "gpipe", 4, "never", 1),
        (4, "1f1b", 4, "always", 1),
        (4, "interleaved_1f1b", 4, "never", 2),
        (4, "zb_h1", 3, "except_last", 1),
    )
]


@pytest.mark.parametrize(("name", "pp", "schedule", "m", "recompute", "v"), CASES)
def test_skips_train_like_one_device(
    name: str, pp: int, schedule: str, m: int, recompute: str, v: int
) -> None:
    args = (name, pp, schedule, m, recompute, 1, 1, v)
    got = run_distributed(worker, pp, *args, timeout=300, init_group=False)
    _assert_matches(got, name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_encoder_decoder_with_tensor_parallelism(schedule: str) -> None:
    """pp=2 x tp=2: the encoder output travels whole to the decoder stage, whose cross-attention
    projections are column- and row-parallel."""
    got = run_distributed(worker, 4, "seq2seq", 2, schedule, 2, "never", 2, timeout=300, init_group=False)
    assert "ColumnParallelLinear" in got[0]["kinds"]
    _assert_matches(got, "seq2seq")


@pytest.mark.parametrize(
    "options",
    [{}, {"shard_optimizer_state": True}, {"shard_parameters": True}],
    ids=["ddp", "zero1", "fsdp2"],
)
def test_unet_with_data_parallelism(options: dict[str, Any]) -> None:
    """dp=2 x pp=2: each replica's skips travel within its own pipeline; with the optimizer state
    or the parameters sharded over the replicas (under FSDP2 the skips leave each stage's FSDP unit
    from inside it: ``x1``..``x3`` are intermediates of stage 0's unit, not its output)."""
    args = ("unet", 2, "1f1b", 2, "never", 1, 2, 1, options)
    got = run_distributed(worker, 4, *args, timeout=300, init_group=False)
    _assert_matches(got, "unet", dp=2)


@pytest.mark.parametrize(
    ("name", "schedule", "m", "recompute", "v"),
    [
        ("unet", "zb_h1", 2, "always", 1),
        ("unet", "interleaved_1f1b", 4, "except_last", 2),
        ("seq2seq", "zb_h1", 2, "except_last", 1),
    ],
)
def test_zero1_overlap_with_skips_split_backward_and_virtual_stages(
    name: str, schedule: str, m: int, recompute: str, v: int
) -> None:
    """dp=2 x pp=2 under ZeRO-1 with its overlapped gather: the layers' waiting pre-hooks sit on
    the Stash/Pop wrappers the executor calls, fire again (with nothing to wait for) when a
    recomputation or zero-bubble's replay runs the forward inside the backward, and a rank holding
    two virtual stages waits for each stage's buckets at its own layers."""
    args = (name, 2, schedule, m, recompute, 1, 2, v, {"shard_optimizer_state": True})
    got = run_distributed(worker, 4, *args, timeout=300, init_group=False)
    _assert_matches(got, name, dp=2)


def flow_worker(root: str) -> dict[str, Any]:
    """Fit, validate and predict on one Trainer, save; then a new model resumes at pp=4."""
    model, data = _model("unet")
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=90))
    trainer = quiet_trainer(strategy, 2, root, max_epochs=1, enable_checkpointing=False)
    trainer.fit(model, loader(data, BATCH, reference=False))
    validated = trainer.validate(model, DataLoader(data, batch_size=BATCH))[0]["val_loss"]
    predicted = trainer.predict(model, DataLoader(data, batch_size=BATCH))
    trainer.save_checkpoint(Path(root) / "unet.ckpt")
    return {"val": validated, "predict": predicted}


def resume_worker(root: str) -> dict[str, Any]:
    model, data = _model("unet")
    strategy = PipeTPStrategy(pipeline_parallel_size=4, num_microbatches=4, timeout=timedelta(seconds=90))
    trainer = quiet_trainer(strategy, 4, root, max_epochs=2, enable_checkpointing=False)
    trainer.fit(model, loader(data, BATCH, reference=False), ckpt_path=str(Path(root) / "unet.ckpt"))
    return {"state": gather_model_state(model, strategy.runtime.partition, strategy.mesh)}


def test_fit_validate_predict_then_resume_at_another_layout(tmp_path: Path) -> None:
    root = str(tmp_path)
    got = run_distributed(flow_worker, 2, root, timeout=300, init_group=False)
    model, data = _model("unet")
    trainer = fit(model, "auto", 1, loader(data, BATCH, reference=True), max_epochs=1)
    expected_val = trainer.validate(model, DataLoader(data, batch_size=BATCH))[0]["val_loss"]
    expected_predict = trainer.predict(model, DataLoader(data, batch_size=BATCH))
    for rank, result in enumerate(got):
        assert result["val"] == pytest.approx(expected_val, abs=TOL), f"rank {rank}"
        assert len(result["predict"]) == len(expected_predict)
        for mine, theirs in zip(result["predict"], expected_predict, strict=True):
            torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0)
    resumed = run_distributed(resume_worker, 4, root, timeout=300, init_group=False)
    expected, _ = reference("unet")  # two epochs straight through
    for key, value in expected.items():
        torch.testing.assert_close(resumed[0]["state"][key], value, atol=TOL, rtol=0, msg=key)
