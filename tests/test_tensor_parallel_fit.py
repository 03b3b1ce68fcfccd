"""Trainer.fit with tensor parallelism (tp=2, and pp=2 x tp=2) on a tiny GPT ends with the weights
(gathered into a whole-model state dict) and losses of one device, and so does a checkpoint saved
after fit at tp=2 x dp=2 under FSDP2; with dropout it runs and is reproducible; and bad plans fail
at setup with the module's name."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.checkpoint.single_file import consolidate_checkpoint
from lightning_pipe.tensor_parallel.dropout import SEED_OFFSET, RegionDropout
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from lightning_pipe.tensor_parallel.plan import resolve_plan
from tests.distributed import run_distributed
from tests.gpt_models import TinyGPT, token_data
from tests.trainers import fit

TOL = 1e-5
DATA = token_data(32)


def _fit(
    model: TinyGPT, strategy: Any, devices: int, reference: bool, batch: int = 8, accumulate: int = 1
) -> L.Trainer:
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=0) if reference else None
    return fit(
        model, strategy, devices, DataLoader(DATA, batch_size=batch, sampler=sampler),
        max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=accumulate,
    )  # fmt: skip


def tp_worker(pp: int, tp: int, dropout: float, runs: int, dp: int = 1) -> list[dict[str, Any]]:
    out = []
    for _ in range(runs):
        model = TinyGPT(dropout=dropout)
        strategy = PipeTPStrategy(
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            num_microbatches=2,
            timeout=timedelta(seconds=90),
        )
        trainer = _fit(
            model, strategy, pp * tp * dp, reference=False, batch=8 // dp, accumulate=2 if dp > 1 else 1
        )
        state = gather_model_state(model, strategy.runtime.partition, strategy.mesh)  # whole model, on rank 0
        kinds = sorted({type(m).__name__ for m in model.modules() if "Parallel" in type(m).__name__})
        replicated = {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank
            and tensor_parallel_dim(p) is None
        }
        out.append({
            "state": state,
            "replicated": replicated,
            "coords": strategy.mesh.coordinates,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "sharded": kinds,
        })  # fmt: skip
    return out


def _reference(dropout: float = 0.0, accumulate: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    model = TinyGPT(dropout=dropout)
    trainer = _fit(model, "auto", 1, reference=True, accumulate=accumulate)
    return model.state_dict(), {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.distributed
@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 2)], ids=["tp2", "pp2xtp2"])
def test_tensor_parallel_fit_matches_one_device(pp: int, tp: int) -> None:
    got = run_distributed(tp_worker, pp * tp, pp, tp, 0.0, 1, timeout=300, init_group=False)
    ref_state, ref_metrics = _reference()
    rank0 = got[0][0]
    assert "ColumnParallelLinear" in rank0["sharded"] and "VocabParallelEmbedding" in rank0["sharded"]
    assert rank0["state"].keys() == ref_state.keys()
    for key, expected in ref_state.items():
        torch.testing.assert_close(rank0["state"][key], expected, atol=TOL, rtol=0, msg=key)
    for rank, runs in enumerate(got):
        for key, value in ref_metrics.items():
            assert runs[0]["metrics"][key] == pytest.approx(value, abs=TOL), f"rank {rank}: {key}"
    _assert_replicas_identical(got)


def _assert_replicas_identical(got: list[list[dict[str, Any]]]) -> None:
    """LayerNorms and row-parallel biases must hold the same values on every tensor rank."""
    by_stage: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for runs in got:
        c = runs[0]["coords"]
        by_stage.setdefault((c.dp_rank, c.pp_rank), []).append(runs[0]["replicated"])
    for copies in by_stage.values():
        assert copies[0], "each stage has replicated parameters"
        for other in copies[1:]:
            for name, value in copies[0].items():
                torch.testing.assert_close(other[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.distributed
def test_dp2_pp2_tp2_on_eight_processes_matches_one_device() -> None:
    """All three axes at once, with accumulate_grad_batches=2: each replica sees half of every batch
    of 8; one device sees the whole batches."""
    got = run_distributed(tp_worker, 8, 2, 2, 0.0, 1, 2, timeout=400, init_group=False)
    ref_state, _ = _reference(accumulate=2)
    state = got[0][0]["state"]
    for key, expected in ref_state.items():
        torch.testing.assert_close(state[key], expected, atol=TOL, rtol=0, msg=key)
    _assert_replicas_identical(got)


def save_after_fit_worker(path: str) -> None:
    model = TinyGPT()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=1, tensor_parallel_size=2, num_microbatches=2, shard_parameters=True,
        timeout=timedelta(seconds=90),
    )  # fmt: skip
    trainer = _fit(model, strategy, 4, reference=False, batch=4, accumulate=2)
    trainer.save_checkpoint(path)  # after fit: Lightning's teardown has moved the model


@pytest.mark.distributed
def test_tensor_parallel_under_fully_sharded_data_parallel_saved_after_fit_matches_one_device(
    tmp_path: Path,
) -> None:
    """tp=2 x dp=2 with shard_parameters=True, fit then ``trainer.save_checkpoint``: the checkpoint
    holds the whole model of one device. Each layer is an FSDP2 unit: the head's vocab-parallel
    logits (a ``Linear`` with a bias returns a view, which the unit copies) keep their
    tensor-parallel group, so the loss stays vocab-parallel (a copy without it failed: "Target 15
    is out of bounds"), and the teardown's move to the host no longer drops the parameters'
    tensor-parallel dims (the checkpoint said ``tp_dim: null`` and held half the vocabulary)."""
    path = tmp_path / "after-fit.ckpt"
    run_distributed(save_after_fit_worker, 4, str(path), timeout=300, init_group=False)
    saved = consolidate_checkpoint(path)["state_dict"]
    reference, _ = _reference(accumulate=2)
    assert saved.keys() == reference.keys()
    for key, expected in reference.items():
        torch.testing.assert_close(saved[key], expected, atol=TOL, rtol=0, msg=key)


@pytest.mark.distributed
def test_tensor_parallel_dropout_runs_and_is_reproducible() -> None:
    got = run_distributed(tp_worker, 2, 1, 2, 0.1, 2, timeout=300, init_group=False)
    first, second = got[0]
    for key, value in first["state"].items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(second["state"][key], value, atol=0, rtol=0, msg=key)
    # Dropout really acted: the weights differ from the run without it by far more than the 1e-5
    # that separates layouts of the same computation.
    no_dropout, _ = _reference()
    gap = (first["state"]["layers.1.mlp.0.weight"] - no_dropout["layers.1.mlp.0.weight"]).abs().max()
    assert gap > 1e-3


@pytest.mark.parametrize(
    ("plan", "tp", "error", "pattern"),
    [
        (
            {"layers.*.atn.qkv": "colwise"},
            2,
            ValueError,
            r"'layers\.\*\.atn\.qkv' matches no module of TinyGPT",
        ),
        (
            {"layers.*.ln1": "colwise"},
            2,
            TypeError,
            r"Style 'colwise' applies to Linear layers, but 'layers.1.ln1'",
        ),
        (
            {"layers.*.mlp.0": "diagonal"},
            2,
            ValueError,
            r"Unknown tensor-parallel style 'diagonal'.*'rowwise'",
        ),
        (
            {"layers.0.tokens": "vocab"},
            3,
            ValueError,
            r"vocabulary size \(num_embeddings\) of 'layers.0.tokens' is 16",
        ),
        ({"layers.*.attn.qkv": "colwise"}, 8, ValueError, r"'layers.1.attn' has 4 attention heads.*8 ranks"),
    ],
    ids=["no-match", "wrong-type", "unknown-style", "not-divisible", "too-few-heads"],
)
def test_bad_plans_are_refused_naming_the_module(
    plan: dict[str, str], tp: int, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        resolve_plan(TinyGPT(), plan, tp)


def _record_masks(model: TinyGPT, kind: type) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every call of every ``kind`` module in the blocks, in call order."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block in list(model.layers)[1:3]:
        for module in block.modules():
            if type(module) is kind:
                module.register_forward_hook(
                    lambda m, args, out: calls.append((args[0].detach().clone(), out.detach().clone()))
                )
    return calls


def dropout_mask_worker() -> dict[str, Any]:
    model = TinyGPT(dropout=0.1)
    strategy = PipeTPStrategy(tensor_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=90))

    class Recorder(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # After setup: attn.drop is a RegionDropout now, each block's own drop a plain Dropout.
            self.regions = _record_masks(pl_module, RegionDropout)
            self.replicated = _record_masks(pl_module, torch.nn.Dropout)

    recorder = Recorder()
    fit(model, strategy, 2, DataLoader(DATA, batch_size=8), max_epochs=1, callbacks=[recorder])
    return {
        "tp_rank": strategy.mesh.coordinates.tp_rank,
        "regions": recorder.regions,
        "replicated": recorder.replicated,
    }


@pytest.mark.distributed
def test_tensor_parallel_dropout_masks() -> None:
    """Replicated activations get the same mask on both tensor ranks; ``"dropout"`` entries get
    different masks per rank, exactly the ones a generator seeded ``2718 + tp_rank`` draws (seed 0:
    no seed_everything), and they drop about 10% of the elements."""
    got = run_distributed(dropout_mask_worker, 2, timeout=300, init_group=False)
    assert [r["tp_rank"] for r in got] == [0, 1]
    # 4 steps x 2 micro-batches x 2 blocks
    assert len(got[0]["regions"]) == len(got[0]["replicated"]) == 16
    for (x0, y0), (x1, y1) in zip(got[0]["replicated"], got[1]["replicated"], strict=True):
        torch.testing.assert_close(x0, x1, atol=0, rtol=0)
        assert torch.equal(y0 == 0, y1 == 0)  # the same elements dropped on both ranks
    dropped = []
    for result in got:
        generator = torch.Generator().manual_seed(SEED_OFFSET + result["tp_rank"])
        for x, y in result["regions"]:
            keep = torch.empty_like(x).bernoulli_(0.9, generator=generator)
            live = x != 0  # causally masked probabilities are zero before dropout
            assert torch.equal((y != 0)[live], (keep != 0)[live])
            torch.testing.assert_close(y, x * keep / 0.9, atol=1e-7, rtol=0)
            dropped.append(float((keep == 0).float().mean()))
    # Each rank drew its own mask: the two ranks' first masks (same shape) differ in many places.
    first = [r["regions"][0][1] != 0 for r in got]
    assert (first[0] != first[1]).float().mean() > 0.05
    assert 0.07 < sum(dropped) / len(dropped) < 0.13
