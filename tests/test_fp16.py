"""``precision="16-mixed"`` under pipe_tp: the gradient scaler's inf/NaN check
is agreed over every rank of the model before any rank steps.

pp=2 x tp=2 (4 processes) trains the tiny GPT with an fp16 gradient scaler on the CPU (the
scaler's logic needs no GPU); at one step an inf is injected into the gradient of *one* rank only
(stage 0, tensor rank 1). Every rank must skip that step and halve its scale, as one device does:
the weights after two epochs equal one device's with the same injection (a stage that stepped
alone would be a whole SGD step away), every rank ends with the same scale as one device, and
the scale is saved in the sharded checkpoint and restored on resume.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from tests.distributed import run_distributed
from tests.gpt_models import TinyGPT, token_data
from tests.trainers import quiet_trainer

DATA = token_data(32)
INJECT_AT = 2  # the global step whose gradients get an inf
TOL = 2e-3  # fp16 autocast on micro-batches of 2 vs the batch of 8; a skipped step moves ~1e-2


class InjectInf(L.Callback):
    """Puts an inf into one gradient element at step INJECT_AT, on the rank(s) ``where`` says."""

    def __init__(self, where: Any) -> None:
        self.where, self.scales = where, []  # type: ignore[var-annotated]

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == INJECT_AT and self.where(trainer):
            param = next(p for p in pl_module.parameters() if p.grad is not None and not p.is_meta)
            param.grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


def _trainer(strategy: Any, devices: int, root: str, callbacks: list[Any], epochs: int = 2) -> L.Trainer:
    """An fp16 gradient scaler that starts at 2**10 and grows after 3 steps without an inf."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler)]
    return quiet_trainer(strategy, devices, root, max_epochs=epochs, callbacks=callbacks, plugins=plugins)


def _strategy() -> PipeTPStrategy:
    return PipeTPStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4, timeout=timedelta(seconds=90)
    )


def worker(root: str) -> dict[str, Any]:
    L.seed_everything(7)
    model = TinyGPT(lr=0.1)
    strategy = _strategy()
    inject = InjectInf(lambda trainer: trainer.global_rank == 1)  # stage 0, tensor rank 1 only
    trainer = _trainer(strategy, 4, root, [inject])
    trainer.fit(model, DataLoader(DATA, batch_size=8))
    path = os.path.join(root, "fp16.ckpt")
    trainer.save_checkpoint(path)
    final = gather_model_state(model, strategy.runtime.partition, strategy.mesh)
    # Resume: the scale comes back from the checkpoint.
    resumed: list[float] = []

    class Restored(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            resumed.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]

    again = _trainer(_strategy(), 4, root, [Restored()], epochs=3)
    again.fit(model, DataLoader(DATA, batch_size=8), ckpt_path=path)
    return {"final": final, "scales": inject.scales, "resumed_scale": resumed[0]}


@pytest.mark.distributed
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank_like_one_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # seed_everything below writes PL_GLOBAL_SEED into this process's environment, which later
    # tests' ranks would inherit (it seeds Lightning's DistributedSampler): set through monkeypatch
    # first, so that the end of the test restores the environment as it was.
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(worker, 4, root, timeout=300, init_group=False)
    # The reference: one device, the same scaler, an inf at the same step.
    L.seed_everything(7)
    model = TinyGPT(lr=0.1)  # the same initial weights as every pipe_tp rank built
    inject = InjectInf(lambda trainer: True)
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=7)  # what Lightning injects
    with tempfile.TemporaryDirectory() as root:
        _trainer("auto", 1, root, [inject]).fit(model, DataLoader(DATA, batch_size=8, sampler=sampler))
    expected_scales = inject.scales
    assert expected_scales[INJECT_AT] == expected_scales[INJECT_AT - 1] / 2  # the reference skipped
    for rank, result in enumerate(got):
        assert result["scales"] == expected_scales, f"rank {rank}"
        assert result["resumed_scale"] == expected_scales[-1], f"rank {rank}"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[0]["final"][key], value, atol=TOL, rtol=0, msg=key)


def test_the_pipe_tp_precision_plugins_pickle_for_spawn_and_keep_lightnings_checkpoint_key() -> None:
    """Lightning pickles the trainer for start_method="spawn"; the fp16 scaler's state is stored
    under "MixedPrecision", as one device stores it."""
    import pickle

    from lightning_pipe.strategy.precision import with_global_clipping

    plugin = with_global_clipping(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")))
    assert type(pickle.loads(pickle.dumps(plugin))) is type(plugin)
    assert plugin is not None
    checkpoint = {type(plugin).__qualname__: plugin.state_dict()}
    plugin.on_save_checkpoint(checkpoint)
    assert list(checkpoint) == ["MixedPrecision"]
