"""Trainer calls after fit run on the process groups fit made.

Lightning sets the strategy's environment up again for every call (fit, validate, test, predict).
Each new mesh and set of tied-parameter groups is a set of gloo threads and connections (on NCCL,
communicators with their device buffers) that nothing frees: a script evaluating in a loop grew by
12 threads per call per process. A later call with the same layout reuses the mesh the model was
prepared on, and a runtime built again over a mesh reuses its tied groups, also from a new Trainer.
The numbers those calls give are one device's.
"""

from __future__ import annotations

import copy
import io
import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_pipe import PipeTPStrategy
from lightning_pipe.mesh import ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions, prepared_mesh
from tests.distributed import run_distributed
from tests.lightning_models import TOKENS, VOCAB, TiedLM, loader

pytestmark = pytest.mark.distributed

TOL = 1e-5


class TiedEval(TiedLM):
    """The tied model (an embedding on the first stage tied to the head on the last: a tied group
    across the pipeline) with validation, test and predict steps."""

    def _loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).reshape(-1, VOCAB), targets.reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _trainer(strategy: Any, devices: int) -> L.Trainer:
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _session(strategy: Any, devices: int, again: Any = None) -> dict[str, Any]:
    model = TiedEval()
    trainer = _trainer(strategy, devices)
    trainer.fit(model, loader(TOKENS, 4, reference=devices == 1))  # the same shuffled order
    evaluate = DataLoader(TOKENS, batch_size=4)
    out: dict[str, Any] = {"threads": [_threads()], "same_mesh": [], "same_tied": []}
    mesh = getattr(trainer.strategy, "mesh", None)
    tied = [g for _, g, _ in trainer.strategy.runtime.gradients.tied] if mesh is not None else []
    if mesh is not None:
        # The prepared model still copies and pickles (an EMA or SWA copy, torch.save(model)):
        # a copy shares the mesh, a pickle leaves it out.
        out["copy_shares_mesh"] = prepared_mesh(copy.deepcopy(model), mesh.layout) is mesh
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        out["pickle_drops_mesh"] = prepared_mesh(torch.load(buffer, weights_only=False), mesh.layout) is None
    for _ in range(3):
        out["val"] = trainer.validate(model, evaluate, verbose=False)[0]["val_loss"]
        out["threads"].append(_threads())
    out["test"] = trainer.test(model, evaluate, verbose=False)[0]["test_loss"]
    out["predict"] = torch.cat(trainer.predict(model, DataLoader(TOKENS, batch_size=4)))  # type: ignore[arg-type]
    out["threads"].append(_threads())
    if mesh is not None:
        out["same_mesh"].append(trainer.strategy.mesh is mesh)
        out["same_tied"].append([g for _, g, _ in trainer.strategy.runtime.gradients.tied] == tied)
    # A new Trainer over the same (prepared) model: its strategy finds the model's mesh.
    second = _trainer(again if again is not None else strategy, devices)
    out["second_val"] = second.validate(model, evaluate, verbose=False)[0]["val_loss"]
    out["threads"].append(_threads())
    if mesh is not None:
        out["same_mesh"].append(second.strategy.mesh is mesh)
        out["same_tied"].append([g for _, g, _ in second.strategy.runtime.gradients.tied] == tied)
        out["tied_groups"] = len(tied)
    return out


def _worker() -> dict[str, Any]:
    torch.set_num_threads(1)

    def strategy() -> PipeTPStrategy:
        return PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))

    return _session(strategy(), 2, again=strategy())


def test_calls_after_fit_reuse_the_process_groups_and_give_one_devices_numbers() -> None:
    got = run_distributed(_worker, 2, timeout=300, init_group=False)
    ref = _session("auto", 1)
    for r in got:
        assert r["tied_groups"] == 1  # the embedding and the head, on the two pipeline ranks
        assert r["copy_shares_mesh"] and r["pickle_drops_mesh"]
        assert r["same_mesh"] == [True, True]
        assert r["same_tied"] == [True, True]
        # Each call used to add 12 threads a process (the mesh's groups); a thread may come and go.
        assert max(r["threads"]) - r["threads"][0] <= 2, r["threads"]
        for key in ("val", "test", "second_val"):
            assert r[key] == pytest.approx(ref[key], abs=TOL), key
    # The predictions are the last stage's (rank 1); each rank returns what it holds.
    torch.testing.assert_close(got[1]["predict"], ref["predict"], atol=TOL, rtol=0)


def _one_rank_worker() -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    mesh = init_mesh(ParallelLayout(1, 1, 1), "cpu")
    first, again = mesh.subgroup([[0]]), mesh.subgroup([[0]])
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ParallelRuntime(model, list(model), mesh, torch.device("cpu"), RuntimeOptions(), seed=0).close()
    out = {
        "cached": first is again and first is not None,
        "prepared": prepared_mesh(model, mesh.layout) is mesh,
        "other_layout": prepared_mesh(model, ParallelLayout(data_parallel_size=2)) is None,
        "live": mesh.is_live(),
    }
    dist.destroy_process_group()  # every group with it: the mesh is no longer one to reuse
    out["live_after_destroy"] = mesh.is_live()
    out["prepared_after_destroy"] = prepared_mesh(model, mesh.layout) is None
    return out


def test_a_mesh_keeps_its_subgroups_and_is_reused_only_while_its_groups_live() -> None:
    (got,) = run_distributed(_one_rank_worker, 1, timeout=60)
    assert got == {
        "cached": True,
        "prepared": True,
        "other_layout": True,
        "live": True,
        "live_after_destroy": False,
        "prepared_after_destroy": True,
    }
