"""Checkpoints under pipe_tp: exact resume, moving between layouts, consolidation, plain in.

Every comparison is with numbers, after several optimizer steps with momentum (so a lost or
mis-cut optimizer state changes the weights), gradient accumulation and a per-step LR scheduler:

* Epoch-boundary resume on the same layout (pp=2 x tp=2 on a tiny GPT; dp=2 x pp=2 with Adam on a
  regressor) gives the uninterrupted run's losses and final weights (within 1e-6).
* The pp=2 x tp=2 checkpoint resumed at pp=4 x tp=1, at one device under pipe_tp, and
  (consolidated) on one device with ``strategy="auto"`` gives the same next losses and weights
  (within 1e-5: the layouts sum in different orders).
* The consolidated file (function and ``python -m lightning_pipe.consolidate``) loads into the plain
  module with ``strict=True`` and holds the weights the sharded run had.
* A plain single-device checkpoint starts pp=2 x tp=2 training that continues like one device.
* A mid-epoch resume at pp=2 behaves as plain Lightning's does on one device with the same loader.
* Tied weights (embedding on stage 0, head on stage 1) resume exactly and on one device; a name
  outside the layer list for a layer (``self.head = self.layers[-1]``) is saved trained.
* Mismatched or damaged checkpoints fail on every rank with the cause: 48 bytes flipped inside a
  weight (resumed at the saving layout and at another, consolidated, exported, loaded) name the
  file and the tensor; metadata that lost an entry is damaged (never "keys do not match", whatever
  ``strict_loading`` is), as consolidation says; a checkpoint without checksums still resumes.
* A fit, a ``save_checkpoint`` without ``weights_only`` and a resume print Lightning's
  "`weights_only` was not set" once (rank 0), not on every rank.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_pipe
from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint, is_checkpoint_directory
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.consolidate import main as consolidate_main
from tests.checkpoint_files import drop_checksums, edit_metadata, flip_tensor_bytes
from tests.distributed import run_distributed
from tests.gpt_models import TinyGPT, token_data
from tests.lightning_models import TOKENS, Regressor, TiedLM, dataset
from tests.trainers import fit, quiet_trainer

pytestmark = pytest.mark.distributed

EXACT, ACROSS = 1e-6, 1e-5
GPT_DATA = token_data(32)
REG_DATA = dataset(40, seed=1)
TIMEOUT = timedelta(seconds=90)


class ScheduledGPT(TinyGPT):
    """TinyGPT with SGD + momentum and a per-step LR scheduler."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class AdamRegressor(Regressor):
    """Regressor with Adam (whose state holds a scalar step next to the moment tensors)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Losses(L.Callback):
    """Every training batch's loss, with the global step it ran at."""

    def __init__(self) -> None:
        self.values: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.values.append((trainer.global_step, float(outputs["loss"])))


@dataclass
class Run:
    losses: list[tuple[int, float]]
    state: dict[str, torch.Tensor]  # the whole model's weights at the end (on rank 0; {} elsewhere)
    global_step: int


def _fit(
    model: L.LightningModule,
    data: TensorDataset,
    strategy: Any,
    devices: int,
    root: str,
    max_epochs: int = -1,
    max_steps: int = -1,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    batch: int = 8,
) -> Run:
    """One fit; pipe_tp gets Lightning's injected DistributedSampler, one device the same explicitly."""
    losses = Losses()
    callbacks: list[Any] = [losses]
    if save_to is not None:  # an epoch-end checkpoint, as a run stopped at an epoch boundary leaves
        callbacks.append(ModelCheckpoint(dirpath=os.path.dirname(save_to), filename=Path(save_to).stem))
    single = not isinstance(strategy, PipeTPStrategy)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0) if single else None
    trainer = fit(
        model, strategy, devices, DataLoader(data, batch_size=batch, sampler=sampler), root, ckpt_path,
        max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
        enable_checkpointing=save_to is not None, callbacks=callbacks,
    )  # fmt: skip
    if single:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = gather_model_state(model, strategy.runtime.partition, strategy.mesh)
    return Run(losses.values, state, trainer.global_step)


def _pipe(pp: int, tp: int = 1, dp: int | str = "auto", **kwargs: Any) -> PipeTPStrategy:
    return PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp, num_microbatches=2,
        timeout=TIMEOUT, **kwargs,
    )  # fmt: skip


# ------------------------------------------------------------------------------ workers
def gpt_pp2_tp2_worker(root: str, plain: str) -> dict[str, Run]:
    ckpt = os.path.join(root, "sharded", "epoch-boundary.ckpt")
    return {
        "uninterrupted": _fit(ScheduledGPT(), GPT_DATA, _pipe(2, 2), 4, root, max_epochs=4),
        "interrupted": _fit(ScheduledGPT(), GPT_DATA, _pipe(2, 2), 4, root, max_epochs=2, save_to=ckpt),
        "resumed": _fit(ScheduledGPT(), GPT_DATA, _pipe(2, 2), 4, root, max_epochs=4, ckpt_path=ckpt),
        "from_plain": _fit(ScheduledGPT(), GPT_DATA, _pipe(2, 2), 4, root, max_epochs=4, ckpt_path=plain),
    }


def gpt_resume_worker(ckpt: str, pp: int, devices: int) -> Run:
    root = os.path.dirname(ckpt)
    return _fit(ScheduledGPT(), GPT_DATA, _pipe(pp), devices, root, max_epochs=4, ckpt_path=ckpt)


def regressor_dp2_pp2_worker(root: str) -> dict[str, Run]:
    ckpt = os.path.join(root, "dp", "epoch-boundary.ckpt")

    def run(**kwargs: Any) -> Run:
        return _fit(AdamRegressor(), REG_DATA, _pipe(2, dp=2), 4, root, batch=4, **kwargs)

    return {
        "uninterrupted": run(max_epochs=4),
        "interrupted": run(max_epochs=2, save_to=ckpt),
        "resumed": run(max_epochs=4, ckpt_path=ckpt),
    }


def _mid_epoch(strategy_factory: Any, devices: int, root: str) -> Run:
    """Stop after 2 optimizer steps (batch 4 of the 5 in epoch 0), save, resume for 2 epochs."""
    trainer = quiet_trainer(
        strategy_factory(), devices, root, max_steps=2, accumulate_grad_batches=2, gradient_clip_val=1.0
    )
    single = not isinstance(trainer.strategy, PipeTPStrategy)
    sampler = DistributedSampler(REG_DATA, num_replicas=1, rank=0, seed=0) if single else None
    trainer.fit(Regressor(), DataLoader(REG_DATA, batch_size=8, sampler=sampler))
    progress = trainer.fit_loop.epoch_loop.batch_progress
    assert trainer.global_step == 2 and progress.current.completed == 4 and not progress.is_last_batch
    path = os.path.join(root, "mid-epoch.ckpt")
    trainer.save_checkpoint(path)
    return _fit(Regressor(), REG_DATA, strategy_factory(), devices, root, max_epochs=2, ckpt_path=path)


def mid_epoch_worker(root: str) -> Run:
    return _mid_epoch(lambda: _pipe(2), 2, root)


# ------------------------------------------------------------------------------ fixtures
@dataclass
class GPTRuns:
    root: str
    pipe: dict[str, Run]
    plain_resumed: Run  # one device, from its own epoch-2 checkpoint
    consolidated_resumed: Run  # one device, from the consolidated pp2 x tp2 checkpoint
    pp4: Run
    pipe_one_device: Run

    @property
    def sharded(self) -> str:
        return os.path.join(self.root, "sharded", "epoch-boundary.ckpt")


@pytest.fixture(scope="module")
def gpt() -> Iterator[GPTRuns]:
    with tempfile.TemporaryDirectory() as root:
        plain = os.path.join(root, "plain", "epoch-boundary.ckpt")
        _fit(ScheduledGPT(), GPT_DATA, "auto", 1, root, max_epochs=2, save_to=plain)
        plain_resumed = _fit(ScheduledGPT(), GPT_DATA, "auto", 1, root, max_epochs=4, ckpt_path=plain)
        pipe = run_distributed(gpt_pp2_tp2_worker, 4, root, plain, timeout=400, init_group=False)[0]
        sharded = os.path.join(root, "sharded", "epoch-boundary.ckpt")
        consolidated = os.path.join(root, "consolidated.ckpt")
        consolidate_checkpoint(sharded, consolidated)
        consolidated_resumed = _fit(
            ScheduledGPT(), GPT_DATA, "auto", 1, root, max_epochs=4, ckpt_path=consolidated
        )
        pp4 = run_distributed(gpt_resume_worker, 4, sharded, 4, 4, timeout=300, init_group=False)[0]
        one = run_distributed(gpt_resume_worker, 1, sharded, 1, 1, timeout=300, init_group=False)[0]
        yield GPTRuns(root, pipe, plain_resumed, consolidated_resumed, pp4, one)


def _assert_same(got: Run, expected: Run, tol: float) -> None:
    assert [s for s, _ in got.losses] == [s for s, _ in expected.losses]
    for (step, loss), (_, ref) in zip(got.losses, expected.losses, strict=True):
        assert loss == pytest.approx(ref, abs=tol), f"loss at global step {step}"
    assert got.state.keys() == expected.state.keys()
    for key, value in expected.state.items():
        torch.testing.assert_close(got.state[key], value, atol=tol, rtol=0, msg=key)


# ------------------------------------------------------------------------------ tests
def test_epoch_boundary_resume_is_exact_pp2_tp2(gpt: GPTRuns) -> None:
    runs = gpt.pipe
    assert runs["interrupted"].global_step == 4 and runs["uninterrupted"].global_step == 8
    # The resumed run continues where the interrupted one stopped: the uninterrupted run's second half.
    second_half = Run(runs["uninterrupted"].losses[8:], runs["uninterrupted"].state, 8)
    _assert_same(runs["resumed"], second_half, EXACT)
    # A fresh start would see the same first batch at the initial weights: 1000x the tolerance away.
    fresh = runs["uninterrupted"].losses[0][1]
    assert abs(runs["resumed"].losses[0][1] - fresh) > 1e-3


def test_checkpoint_is_a_sharded_directory_with_layout_metadata(gpt: GPTRuns) -> None:
    import json

    assert is_checkpoint_directory(gpt.sharded)
    files = sorted(os.listdir(gpt.sharded))
    assert files == [
        "HOW_TO_LOAD.txt", "lightning_state.pt", "pipe_tp_metadata.json",
        "shard-pp0-tp0.pt", "shard-pp0-tp1.pt", "shard-pp1-tp0.pt", "shard-pp1-tp1.pt",
    ]  # fmt: skip
    meta = json.loads((Path(gpt.sharded) / "pipe_tp_metadata.json").read_text())
    assert meta["layout"] == {"data_parallel_size": 1, "pipeline_parallel_size": 2, "tensor_parallel_size": 2}
    # A column-parallel weight of stage 1 is split across both tensor ranks' files along dim 0...
    qkv = meta["model"]["layers.2.attn.qkv.weight"]
    assert qkv["files"] == ["shard-pp1-tp0.pt", "shard-pp1-tp1.pt"] and qkv["tp_dim"] == 0
    assert qkv["shape"] == [48, 16]
    # ... a replicated one lives once, and the momentum of a row-parallel weight is split along dim 1.
    assert meta["model"]["layers.1.ln1.weight"]["files"] == ["shard-pp0-tp0.pt"]
    momentum = meta["optimizers"][0]["layers.1.attn.proj.weight"]["momentum_buffer"]
    assert momentum["files"] == ["shard-pp0-tp0.pt", "shard-pp0-tp1.pt"] and momentum["tp_dim"] == 1
    # No rank wrote the whole model: each shard file is a fraction of the consolidated checkpoint.
    whole = os.path.getsize(os.path.join(gpt.root, "consolidated.ckpt"))
    for name in files:
        if name.startswith("shard-"):
            assert os.path.getsize(os.path.join(gpt.sharded, name)) < 0.6 * whole, name
    # No temporary directory is left beside it.
    assert sorted(os.listdir(os.path.dirname(gpt.sharded))) == ["epoch-boundary.ckpt"]


def test_reshard_pp2_tp2_to_pp4_and_one_device(gpt: GPTRuns) -> None:
    reference = gpt.consolidated_resumed  # strategy="auto" on one device, from the consolidated file
    assert reference.global_step == 8 and len(reference.losses) == 8
    _assert_same(gpt.pp4, reference, ACROSS)
    _assert_same(gpt.pipe_one_device, reference, ACROSS)
    _assert_same(gpt.pipe["resumed"], reference, ACROSS)


def test_consolidated_checkpoint_loads_strictly_into_the_plain_module(gpt: GPTRuns) -> None:
    saved = torch.load(os.path.join(gpt.root, "consolidated.ckpt"), weights_only=True)
    model = ScheduledGPT()
    model.load_state_dict(saved["state_dict"], strict=True)
    for key, value in gpt.pipe["interrupted"].state.items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)
    assert saved["global_step"] == 4 and saved["epoch"] == 1  # saved at the end of epoch 1
    assert len(saved["optimizer_states"][0]["state"]) == len(list(model.parameters()))
    assert "param_names" not in saved["optimizer_states"][0]
    # The command-line tool writes the same tensors.
    out = os.path.join(gpt.root, "cli.ckpt")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.consolidate", gpt.sharded, out, "--weights-only"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "saved with dp=1 x pp=2 x tp=2" in done.stdout
    cli = torch.load(out, weights_only=True)
    assert "optimizer_states" not in cli
    for key, value in saved["state_dict"].items():
        assert torch.equal(cli["state_dict"][key], value), key


def test_load_from_checkpoint_reads_a_sharded_directory_into_the_plain_module(gpt: GPTRuns) -> None:
    """Lightning's classmethod reads files only; ours takes the directory too,
    and the directory says how (for whoever meets the IsADirectoryError and looks inside)."""
    with pytest.raises(IsADirectoryError):
        ScheduledGPT.load_from_checkpoint(gpt.sharded)
    assert (
        "lightning_pipe.load_from_checkpoint(MyModel" in (Path(gpt.sharded) / "HOW_TO_LOAD.txt").read_text()
    )
    model = lightning_pipe.load_from_checkpoint(ScheduledGPT, gpt.sharded, map_location="cpu")
    assert type(model) is ScheduledGPT
    interrupted = gpt.pipe["interrupted"].state
    assert model.state_dict().keys() == interrupted.keys()
    for key, value in interrupted.items():
        assert torch.equal(model.state_dict()[key], value), key
    # A file goes straight to Lightning's classmethod.
    from_file = lightning_pipe.load_from_checkpoint(ScheduledGPT, os.path.join(gpt.root, "consolidated.ckpt"))
    for key, value in interrupted.items():
        assert torch.equal(from_file.state_dict()[key], value), key


def test_plain_checkpoint_starts_pipe_tp_training(gpt: GPTRuns) -> None:
    _assert_same(gpt.pipe["from_plain"], gpt.plain_resumed, ACROSS)


def test_epoch_boundary_resume_is_exact_dp2_pp2_adam() -> None:
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(regressor_dp2_pp2_worker, 4, root, timeout=400, init_group=False)
    uninterrupted, interrupted, resumed = runs[0]["uninterrupted"], runs[0]["interrupted"], runs[0]["resumed"]
    half = len(interrupted.losses)
    assert half == 10 and len(uninterrupted.losses) == 20  # 20 samples per replica, batch 4, 2 epochs
    _assert_same(resumed, Run(uninterrupted.losses[half:], uninterrupted.state, 0), EXACT)
    # The other replica (its own half of the data) also continues exactly where it stopped.
    other = runs[2]
    assert other["resumed"].losses != resumed.losses
    _assert_same(other["resumed"], Run(other["uninterrupted"].losses[half:], {}, 0), EXACT)


def test_mid_epoch_resume_matches_lightning_on_one_device() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(mid_epoch_worker, 2, root, timeout=300, init_group=False)[0]
    with tempfile.TemporaryDirectory() as root:
        expected = _mid_epoch(lambda: "auto", 1, root)
    assert expected.losses, "the resumed single-device run trained nothing"
    _assert_same(got, expected, ACROSS)


# ------------------------------------------------------------------------------ bad checkpoints
class WiderRegressor(Regressor):
    """The Regressor with one hidden layer wider: the same keys, other shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[2] = torch.nn.Linear(16, 17)
        self.layers[4] = torch.nn.Linear(17, 16)


class DeeperRegressor(Regressor):
    """The Regressor with one more layer: two keys the checkpoint lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers.append(torch.nn.Linear(self.layers[6].out_features, self.layers[6].out_features))


def _fit_error(model: L.LightningModule, ckpt: str, root: str, pp: int = 2) -> tuple[str, str]:
    """The exception fitting ``model`` from ``ckpt`` on two ranks at ``pp`` raises on this rank."""
    trainer = quiet_trainer(_pipe(pp), 2, root, max_epochs=1)
    try:
        trainer.fit(model, DataLoader(REG_DATA, batch_size=8), ckpt_path=ckpt)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


def _save_errors(trainer: L.Trainer, root: str) -> dict[str, tuple[str, str]]:
    """Saves that must fail on every rank at once (a rank left waiting would hang until the timeout)."""

    def attempt(path: str) -> tuple[str, str]:
        try:
            trainer.save_checkpoint(path)
        except Exception as err:
            return type(err).__name__, str(err)
        return "no error", ""

    out = {}
    if trainer.is_global_zero:
        os.makedirs(os.path.join(root, "data"))
        Path(root, "data", "keep.txt").write_text("precious")
        Path(root, "a_file").write_text("not a directory")
    trainer.strategy.barrier()
    out["save onto data"] = attempt(os.path.join(root, "data"))
    # Only rank 1's optimizer holds a tensor the module does not own: only rank 1 raises, in
    # optimizer_state, before the write begins.
    params = trainer.optimizers[0].param_groups[0]["params"]
    if trainer.global_rank == 1:
        params.append(torch.nn.Parameter(torch.zeros(2)))
    out["foreign optimizer tensor"] = attempt(os.path.join(root, "foreign.ckpt"))
    if trainer.global_rank == 1:
        params.pop()
    # Single-file mode: only rank 0 writes, and fails (the parent is a file); both ranks raise.
    trainer.strategy.save_distributed_checkpoint = False  # type: ignore[attr-defined]
    out["single file"] = attempt(os.path.join(root, "a_file", "single.ckpt"))
    trainer.strategy.save_distributed_checkpoint = True  # type: ignore[attr-defined]
    out["data kept"] = ("kept", str(sorted(os.listdir(os.path.join(root, "data")))))
    return out


class LooseRegressor(Regressor):
    """The Regressor with ``strict_loading = False``: it loads the keys a checkpoint shares."""

    def __init__(self) -> None:
        super().__init__()
        self.strict_loading = False


class WeightsOnlyNotices(logging.Handler):
    """Lightning's log records and Python warnings that mention ``weights_only``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "weights_only" in record.getMessage():
            self.seen.append(record.getMessage())


def _damage(good: str, root: str) -> None:
    """Copies of ``good``, each damaged one way (on rank 0, before the others read them)."""
    names = ("truncated", "incomplete", "flipped", "lost entry", "no checksums")
    copies = {name: os.path.join(root, f"{name}.ckpt") for name in names}
    for copy in copies.values():
        shutil.copytree(good, copy)
    # Every rank reads every file's records (checking them against the metadata): all fail.
    with open(os.path.join(copies["truncated"], "shard-pp1-tp0.pt"), "r+b") as f:
        f.truncate(100)
    os.remove(os.path.join(copies["incomplete"], "shard-pp0-tp0.pt"))
    # A failing disk: 48 bytes of a stage-1 weight changed, the zip intact (torch.load loads it).
    # At pp=2 only pp_rank 1 reads that tensor: rank 0 must fail with it, not wait for it.
    flip_tensor_bytes(Path(copies["flipped"], "shard-pp1-tp0.pt"), ("model", "layers.4.weight"), 48)
    # The metadata lost the record of a tensor that stage 1's file still holds.
    edit_metadata(Path(copies["lost entry"]), lambda data: data["model"].pop("layers.4.bias"))
    drop_checksums(Path(copies["no checksums"]))  # as written before checksums were recorded
    saved = consolidate_checkpoint(good)
    saved["state_dict"].update(WiderRegressor().state_dict())
    torch.save(saved, os.path.join(root, "wide-plain.ckpt"))


def bad_checkpoints_worker(root: str) -> dict[str, tuple[str, str]]:
    notices = WeightsOnlyNotices()
    logging.getLogger("lightning.pytorch").addHandler(notices)
    good = os.path.join(root, "good.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(Regressor(), _pipe(2), 2, DataLoader(REG_DATA, batch_size=8), root, max_steps=1)
        trainer.save_checkpoint(good)  # no weights_only: Lightning says so, once (rank 0)
        resumed = _fit_error(Regressor(), good, root)
    said = notices.seen + [str(w.message) for w in caught if "weights_only" in str(w.message)]
    if trainer.is_global_zero:
        _damage(good, root)
    trainer.strategy.barrier()
    saving = _save_errors(trainer, root)
    damaged = {name: os.path.join(root, f"{name}.ckpt") for name in ("flipped", "lost entry")}
    return {
        **saving,
        "shapes": _fit_error(WiderRegressor(), good, root),
        "keys": _fit_error(DeeperRegressor(), good, root),
        "truncated": _fit_error(Regressor(), os.path.join(root, "truncated.ckpt"), root),
        "incomplete": _fit_error(Regressor(), os.path.join(root, "incomplete.ckpt"), root),
        "plain shapes": _fit_error(Regressor(), os.path.join(root, "wide-plain.ckpt"), root),
        "flipped": _fit_error(Regressor(), damaged["flipped"], root),
        "flipped, pp=1": _fit_error(Regressor(), damaged["flipped"], root, pp=1),
        "lost entry": _fit_error(Regressor(), damaged["lost entry"], root),
        "lost entry, not strict": _fit_error(LooseRegressor(), damaged["lost entry"], root),
        "no checksums": _fit_error(Regressor(), os.path.join(root, "no checksums.ckpt"), root),
        "good": resumed,
        "weights_only notices": ("said", repr(said)),
    }


def _consolidation_errors(root: str) -> dict[str, str]:
    """What consolidating each damaged copy says, in this process: the function, the command
    (also to Hugging Face) and ``lightning_pipe.load_from_checkpoint``."""
    out = {}
    for name in ("flipped", "lost entry"):
        path = os.path.join(root, f"{name}.ckpt")
        with pytest.raises(CheckpointError) as info:
            consolidate_checkpoint(path)
        out[name] = str(info.value)
        with pytest.raises(CheckpointError, match=re.escape(out[name])):
            lightning_pipe.load_from_checkpoint(Regressor, path)
        for extra in ([], ["--to-huggingface"]):
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors):
                assert consolidate_main([path, os.path.join(root, "out"), *extra]) == 1
            assert errors.getvalue() == f"error: {out[name]}\n"
    return out


def test_mismatched_or_damaged_checkpoints_fail_on_every_rank_with_the_cause() -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(bad_checkpoints_worker, 2, root, timeout=300, init_group=False)
        consolidating = _consolidation_errors(root)
    notices = [ast.literal_eval(ranks[rank].pop("weights_only notices")[1]) for rank in (0, 1)]
    for case, (kind, message) in ranks[0].items():
        # Every rank raises the same error (a rank that read nothing wrong included), at once.
        assert ranks[1][case] == (kind, message), case
    assert ranks[0]["good"] == ("no error", "")
    # A fit, a save without weights_only and a resume: Lightning's notice once, not per rank.
    assert notices == [["`weights_only` was not set, defaulting to `False`."], []], notices
    # Bit flips inside a tensor, at the saving layout and at another: the file and the tensor named.
    for case, failed in (("flipped", "rank 1:"), ("flipped, pp=1", "ranks [0, 1]:")):
        kind, message = ranks[0][case]
        assert kind == "CheckpointError" and f"failed on {failed}" in message, (case, message)
        assert "shard-pp1-tp0.pt is damaged: the bytes of the model entry 'layers.4.weight'" in message
        assert "CRC32" in message and "Use an earlier checkpoint" in message
    assert (
        "shard-pp1-tp0.pt is damaged: the bytes of the model entry 'layers.4.weight'"
        in (consolidating["flipped"])
    )
    # Metadata that lost an entry: damaged, as consolidation says, whatever strict_loading is.
    lost = "is damaged: its metadata (pipe_tp_metadata.json) does not record 1 value(s) its shard files hold"
    for case in ("lost entry", "lost entry, not strict"):
        kind, message = ranks[0][case]
        assert kind == "CheckpointError" and lost in message, (case, message)
        assert "'layers.4.bias' in shard-pp1-tp0.pt" in message and "earlier checkpoint" in message
        assert "strict_loading" not in message and "does not match" not in message, message
    assert lost in consolidating["lost entry"] and "strict_loading" not in consolidating["lost entry"]
    # A checkpoint written before the checksums were recorded still resumes.
    assert ranks[0]["no checksums"] == ("no error", "")
    kind, message = ranks[0]["shapes"]
    assert kind == "CheckpointError"
    assert (
        "layers.2.weight: saved [16, 16], model [17, 16]" in message
        and "another model configuration" in message
    )
    kind, message = ranks[0]["keys"]
    assert kind == "CheckpointError"
    assert "missing from the checkpoint: ['layers.7.weight', 'layers.7.bias']" in message, message
    kind, message = ranks[0]["truncated"]
    assert kind == "CheckpointError"
    assert "failed on ranks [0, 1]:" in message and "shard-pp1-tp0.pt cannot be read" in message
    assert "damaged" in message
    kind, message = ranks[0]["incomplete"]
    assert kind == "CheckpointError" and "is incomplete" in message and "shard-pp0-tp0.pt" in message
    kind, message = ranks[0]["plain shapes"]
    assert kind == "CheckpointError" and "layers.4.weight: saved [16, 17], model [16, 16]" in message
    # Saving: a user's directory is refused and kept; one rank's failure is every rank's error.
    kind, message = ranks[0]["save onto data"]
    assert kind == "CheckpointError" and "while checking the checkpoint path" in message, message
    assert "is a directory that is not a lightning_pipe checkpoint" in message
    assert ranks[0]["data kept"] == ("kept", "['keep.txt']")
    kind, message = ranks[0]["foreign optimizer tensor"]
    assert kind == "CheckpointError" and "Saving the optimizer state failed on rank 1:" in message, message
    assert "not parameters of the LightningModule" in message and "rank 0:" not in message
    kind, message = ranks[0]["single file"]
    assert kind == "CheckpointError" and "failed on rank 0:" in message and "rank 1:" not in message, message


# ------------------------------------------------------------------------------ tied weights
def tied_worker(root: str) -> dict[str, Run]:
    """Embedding (stage 0) tied to the head (stage 1): both stages hold a copy and its AdamW state."""
    ckpt = os.path.join(root, "tied", "epoch-boundary.ckpt")

    def run(**kwargs: Any) -> Run:
        return _fit(TiedLM(), TOKENS, _pipe(2), 2, root, **kwargs)

    alias = os.path.join(root, "alias", "epoch-boundary.ckpt")
    return {
        "uninterrupted": run(max_epochs=4),
        "interrupted": run(max_epochs=2, save_to=ckpt),
        "resumed": run(max_epochs=4, ckpt_path=ckpt),
        "alias": _fit(AliasedHeadRegressor(), REG_DATA, _pipe(2), 2, root, max_epochs=1, save_to=alias),
    }


class AliasedHeadRegressor(Regressor):
    """``head`` is a second name for the last pipeline layer, outside the layer list: only stage 1
    trains it, so stage 1's copy is the one to save (stage 0 holds the untrained initial values)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = self.layers[-1]


def test_tied_and_aliased_weights_resume_exactly_and_on_one_device() -> None:
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(tied_worker, 2, root, timeout=300, init_group=False)[0]
        ckpt = os.path.join(root, "tied", "epoch-boundary.ckpt")
        consolidated = consolidate_checkpoint(ckpt)
        aliased = consolidate_checkpoint(os.path.join(root, "alias", "epoch-boundary.ckpt"))
        one = run_distributed(tied_one_device_worker, 1, ckpt, timeout=300, init_group=False)[0]
    half = len(runs["interrupted"].losses)
    assert half == 8 and len(runs["uninterrupted"].losses) == 16
    second_half = Run(runs["uninterrupted"].losses[half:], runs["uninterrupted"].state, 0)
    _assert_same(runs["resumed"], second_half, EXACT)
    _assert_same(one, second_half, ACROSS)
    # The tied weight is saved under both of its names, as the plain module's state_dict has it.
    model = TiedLM()
    model.load_state_dict(consolidated["state_dict"], strict=True)
    assert torch.equal(consolidated["state_dict"]["embed.weight"], consolidated["state_dict"]["head.weight"])
    # An alias of a pipeline layer is saved from the stage that trained it.
    trained = runs["alias"].state["layers.6.weight"]
    assert not torch.equal(trained, AliasedHeadRegressor().head.weight)
    saved = aliased["state_dict"]
    assert torch.equal(saved["head.weight"], trained) and torch.equal(saved["layers.6.weight"], trained)


def tied_one_device_worker(ckpt: str) -> Run:
    return _fit(TiedLM(), TOKENS, _pipe(1), 1, os.path.dirname(ckpt), max_epochs=4, ckpt_path=ckpt)


def single_file_worker(root: str) -> None:
    """pp=2 x tp=2: the same trained state saved sharded and as one gathered file."""
    model = ScheduledGPT()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2, timeout=TIMEOUT
    )
    trainer = fit(model, strategy, 4, DataLoader(GPT_DATA, batch_size=8), root, max_epochs=1)
    trainer.save_checkpoint(os.path.join(root, "sharded.ckpt"))
    strategy.save_distributed_checkpoint = False
    trainer.save_checkpoint(os.path.join(root, "single.ckpt"))


def test_single_file_checkpoint_holds_what_the_sharded_one_holds() -> None:
    """``save_distributed_checkpoint=False``: one ordinary file that loads with ``strict=True`` into
    the plain module, with every weight and optimizer tensor equal to the sharded checkpoint's."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(single_file_worker, 4, root, timeout=300, init_group=False)
        assert os.path.isfile(os.path.join(root, "single.ckpt"))
        single = torch.load(os.path.join(root, "single.ckpt"), weights_only=False)
        sharded = consolidate_checkpoint(os.path.join(root, "sharded.ckpt"))
    plain = ScheduledGPT()
    plain.load_state_dict(single["state_dict"], strict=True)
    assert single["state_dict"].keys() == sharded["state_dict"].keys() == plain.state_dict().keys()
    for key, value in sharded["state_dict"].items():
        torch.testing.assert_close(single["state_dict"][key], value, atol=0, rtol=0, msg=key)
    assert single["global_step"] == sharded["global_step"] == 4
    (got,), (expected,) = single["optimizer_states"], sharded["optimizer_states"]
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys() and len(got["state"]) == len(
        list(plain.parameters())
    )
    for index, state in expected["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(
                got["state"][index][name], value, atol=0, rtol=0, msg=f"{index}.{name}"
            )
    # The optimizer state loads into the plain module's optimizer, in parameter order.
    optimizer = plain.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(got)
    assert single["lr_schedulers"] == sharded["lr_schedulers"]
