"""``shard_optimizer_state=True`` (ZeRO-1): each data-parallel replica keeps the optimizer
state of its slices of the gradient buckets, and training ends where one device ends.

* dp=2 with Adam (two parameter groups, a per-step LR schedule) and buckets small enough that
  parameters straddle slice boundaries;
* dp=2 x pp=2 with AdamW, accumulation, global-norm clipping, an embedding tied to the head across
  stages and a parameter no replica uses;
* dp=2 x tp=2 with Adam on residual MLP blocks (column- then row-parallel), and on the tiny GPT
  (SGD with momentum there: see ``tests/gpt_models.py`` on Adam and its key bias).

Each compares the weights after two epochs with one device's (1e-5) and the optimizer-state
elements each rank holds with what an unsharded optimizer over the same parameters would hold
(about half, plus padding). A sharded checkpoint written at dp=2 is consolidated and compared
with one device's optimizer state, and resumes at dp=2 (sharded) and dp=1 (unsharded) to the
weights of an uninterrupted run; an optimizer whose step is not element-wise is refused by name.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from tests.distributed import run_distributed
from tests.gpt_models import TinyGPT, token_data
from tests.lightning_models import IN, OUT, TOKENS, Regressor, TiedLM, dataset, loader
from tests.trainers import fit

TOL = 1e-5
TRAINING = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}  # every layout, and one device


class AdamRegressor(Regressor):
    """Adam with two parameter groups (their own lr and weight decay) and a per-step LR schedule."""

    def configure_optimizers(self) -> Any:
        first = list(self.layers[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        opt = torch.optim.Adam(
            [{"params": first}, {"params": rest, "lr": 0.02, "weight_decay": 0.01}], lr=0.01
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(IN, 4 * IN), nn.Linear(4 * IN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class AdamTensorParallelMLP(AdamRegressor):
    """Residual MLP blocks whose ``up`` is column-parallel and ``down`` row-parallel, with Adam."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(_Block(), _Block(), nn.Linear(IN, OUT))

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class LbfgsRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adafactor(self.parameters(), lr=0.01)


def _model(kind: str) -> L.LightningModule:
    models = {
        "mlp": AdamRegressor,
        "tied": lambda: TiedLM(unused=True),
        "gpt": TinyGPT,
        "tp-mlp": AdamTensorParallelMLP,
    }
    return models[kind]()


def _data(kind: str, batch: int, reference: bool) -> DataLoader:
    if kind in ("mlp", "tp-mlp"):
        return loader(dataset(40, seed=1), batch, reference=reference)
    ds = TOKENS if kind == "tied" else token_data(32)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0) if reference else None
    return DataLoader(ds, batch_size=batch, sampler=sampler)


def layout_worker(kind: str, pp: int, tp: int, overlap: bool = True) -> dict[str, Any]:
    model = _model(kind)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2, shard_optimizer_state=True,
        bucket_cap_mb=0.0004, timeout=timedelta(seconds=90), overlap_param_gather=overlap,
    )  # fmt: skip
    world = int(os.environ["WORLD_SIZE"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, strategy, world, _data(kind, 8 // (world // (pp * tp)), False), max_epochs=2, **TRAINING)
    runtime = strategy.runtime
    (sharded,) = runtime.gradients.sharded.values()
    own = runtime.parameters
    per_element = 1 if kind == "gpt" else 2  # SGD momentum; Adam(W)'s two moments
    tp_dims = {n: tensor_parallel_dim(p) for n, p in model.named_parameters()}
    return {
        "coords": strategy.mesh.coordinates,
        "params": {
            n: p.detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)
            if runtime.partition.stage_of_key(n) in runtime.stage_indices
        },
        "state_elements": sharded.state_elements()
        - sum(1 for s in sharded.optimizer.state.values() if "step" in s),
        # What an unsharded optimizer would hold: state for every parameter that ever had a gradient.
        "unsharded_elements": per_element
        * sum(p.numel() for p in own if runtime.gradients.reducer.used[id(p)]),
        "buckets": len(runtime.gradients.reducer.shards),
        "slice_elements": per_element * sum(t.numel() for t in runtime.gradients.reducer.shards),
        "grads_none": all(p.grad is None for p in own),
        "gradient_sharding": runtime.gradient_sharding.name,
        "gathers": sharded.gather.record,
        "tp_dims": tp_dims,
        "future_warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
    }


def _reference(kind: str) -> dict[str, torch.Tensor]:
    model = _model(kind)
    fit(model, "auto", 1, _data(kind, 8, True), max_epochs=2, **TRAINING)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "pp", "tp", "overlap"),
    [
        ("mlp", 1, 1, True),
        ("mlp", 1, 1, False),
        ("tied", 2, 1, True),
        ("gpt", 1, 2, True),
        ("tp-mlp", 1, 2, True),
    ],
    ids=["dp2", "dp2-blocking-gather", "dp2xpp2", "dp2xtp2-gpt-sgd", "dp2xtp2-adam"],
)
def test_sharded_optimizer_matches_one_device_and_holds_half_the_state(
    kind: str, pp: int, tp: int, overlap: bool
) -> None:
    got = run_distributed(layout_worker, 2 * pp * tp, kind, pp, tp, overlap, timeout=300, init_group=False)
    ref = _reference(kind)
    for r in got:
        gathers = r["gathers"]
        assert gathers.launches > 0
        # With the overlap, each step's gathers were waited for by the next forward (its first
        # layer's hook met later buckets still pending) or, after the last step, at the end of
        # training; without it, by the step itself.
        met = gathers.pending_at_first_forward
        assert len(met) == (gathers.launches - 1 if overlap else 0)
        assert all(n > 0 for n in met) and gathers.reads_caught == 0
        # The flat gathers and scatters use the name torch 2.13 keeps (no deprecation warnings).
        assert not [w for w in r["future_warnings"] if "torch.distributed" in w], r["future_warnings"]
        assert r["grads_none"], "after the step, only slices hold the averaged gradient"
        assert r["gradient_sharding"] == "OPTIMIZER_STATE"  # what the strategy's fp16 refusal reads
        assert r["buckets"] > 1
        # No more than this rank's slices (half of every bucket, padded to even length).
        assert r["state_elements"] <= r["slice_elements"]
        if kind != "tied":  # every parameter used: half of the state, to the padding
            assert (
                abs(r["state_elements"] - r["unsharded_elements"] / 2)
                <= r["slice_elements"] - r["unsharded_elements"] / 2 + 1e-9
            )
    # The replicas of a stage together hold exactly the unsharded state, each element once.
    by_part: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in got:
        by_part.setdefault((r["coords"].pp_rank, r["coords"].tp_rank), []).append(r)
    for replicas in by_part.values():
        assert len(replicas) == 2
        assert sum(r["state_elements"] for r in replicas) == replicas[0]["unsharded_elements"]
    for r in got:  # each tensor rank's slice of every parameter against one device's
        tp_rank = r["coords"].tp_rank
        for name, value in r["params"].items():
            dim, expected = r["tp_dims"].get(name), ref[name]
            if dim is not None:
                expected = expected.chunk(tp, dim=dim)[tp_rank]
            torch.testing.assert_close(value, expected, atol=TOL, rtol=0, msg=f"tp rank {tp_rank}: {name}")
    assert {n for r in got for n in r["params"]} == set(ref)


def refused_worker() -> str:
    try:
        fit(
            LbfgsRegressor(), PipeTPStrategy(shard_optimizer_state=True, pipeline_parallel_size=1), 2,
            _data("mlp", 4, False), max_epochs=2, **TRAINING,
        )  # fmt: skip
    except MisconfigurationException as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_optimizer_that_is_not_elementwise_is_refused_by_name() -> None:
    for message in run_distributed(refused_worker, 2, timeout=120, init_group=False):
        assert "Adafactor is not known to be" in message and "shard_optimizer_state=False" in message


def checkpoint_worker(root: str, mode: str, resume: str | None, distributed: bool = True) -> dict[str, Any]:
    """Fit (or resume) AdamRegressor at dp = the world size with a data axis that is ``"none"``
    (replicated), ``"zero1"`` (optimizer state sharded) or ``"fsdp"`` (shard_parameters), saving
    a checkpoint at each epoch's end; returns the whole weights."""
    from lightning_pipe.data_parallel.sharded_state import full

    model = AdamRegressor()
    world = int(os.environ["WORLD_SIZE"])
    strategy = PipeTPStrategy(
        pipeline_parallel_size=1, num_microbatches=2, shard_optimizer_state=mode == "zero1",
        shard_parameters=mode == "fsdp", bucket_cap_mb=0.0004, timeout=timedelta(seconds=90),
        save_distributed_checkpoint=distributed,
    )  # fmt: skip
    cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, filename="last", save_on_train_epoch_end=True)
    fit(
        model, strategy, world, _data("mlp", 8 // world, False), root, resume,
        max_epochs=2 if resume is None else 4, enable_checkpointing=True, callbacks=[cb], **TRAINING,
    )  # fmt: skip
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def _one_device(epochs: int) -> L.Trainer:
    return fit(AdamRegressor(), "auto", 1, _data("mlp", 8, True), max_epochs=epochs, **TRAINING)


def _assert_state_equal(got: dict[int, Any], expected: dict[int, Any]) -> None:
    assert got.keys() == expected.keys()
    for index, entry in expected.items():
        for key, value in entry.items():
            torch.testing.assert_close(got[index][key], value, atol=TOL, rtol=0, msg=f"{index}.{key}")


def check_checkpoint_moves(tmp_path: Path, writer: tuple[int, str], readers: list[tuple[int, str]]) -> None:
    """A checkpoint directory written at ``writer`` (dp, data-axis mode) consolidates to one
    device's Adam state after two epochs, and resumes at each of ``readers`` for two more epochs to
    the weights of four epochs on one device."""
    from lightning_pipe.checkpoint.single_file import consolidate_checkpoint

    world, mode = writer
    run_distributed(checkpoint_worker, world, str(tmp_path), mode, None, timeout=300, init_group=False)
    saved = tmp_path / "last.ckpt"
    assert saved.is_dir(), "a checkpoint directory"
    whole = consolidate_checkpoint(saved, trust_pickle=True)
    _assert_state_equal(
        whole["optimizer_states"][0]["state"], _one_device(2).optimizers[0].state_dict()["state"]
    )
    reference = dict(_one_device(4).lightning_module.named_parameters())
    for world, mode in readers:
        with tempfile.TemporaryDirectory() as again:
            resumed = run_distributed(
                checkpoint_worker, world, again, mode, str(saved), timeout=300, init_group=False
            )
        for name, value in resumed[0].items():
            torch.testing.assert_close(
                value, reference[name].detach(), atol=TOL, rtol=0, msg=f"{mode} dp={world}: {name}"
            )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("writer", "readers"),
    [((4, "zero1"), [(2, "zero1"), (1, "none")]), ((1, "none"), [(2, "zero1")])],
    ids=["dp4-sharded-to-dp2-and-dp1", "dp1-to-dp2-sharded"],
)
def test_checkpoint_moves_between_sharded_and_unsharded_layouts(
    tmp_path: Path, writer: tuple[int, str], readers: list[tuple[int, str]]
) -> None:
    check_checkpoint_moves(tmp_path, writer, readers)


@pytest.mark.distributed
def test_single_file_checkpoint_holds_the_unsharded_state(tmp_path: Path) -> None:
    """save_distributed_checkpoint=False gathers the whole state into one file on rank 0."""
    run_distributed(checkpoint_worker, 2, str(tmp_path), "zero1", None, False, timeout=300, init_group=False)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    _assert_state_equal(
        saved["optimizer_states"][0]["state"], _one_device(2).optimizers[0].state_dict()["state"]
    )


def fp16_worker() -> str:
    try:
        model = AdamRegressor()
        strategy = PipeTPStrategy(pipeline_parallel_size=1, shard_optimizer_state=True)
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        fit(model, strategy, 2, _data("mlp", 4, False), plugins=[plugin], max_steps=1)
    except MisconfigurationException as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_fp16_with_sharding_is_refused_before_training() -> None:
    for message in run_distributed(fp16_worker, 2, timeout=120, init_group=False):
        assert 'precision="16-mixed" with shard_optimizer_state=True is not supported yet' in message


def second_optimizer_worker() -> str:
    from lightning_pipe.data_parallel.sharded_optimizer import ShardingError
    from lightning_pipe.faults.naming import CollectiveNaming
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime.gradients import Gradients

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = init_mesh(ParallelLayout(2, 1, 1), "cpu")
    gradients = Gradients(list(model.parameters()), [], mesh, CollectiveNaming(mesh.rank), shard=True)
    gradients.shard_optimizer(torch.optim.Adam(model[0].parameters()))
    try:
        gradients.shard_optimizer(torch.optim.Adam(model[1].parameters()))
    except ShardingError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_second_sharded_optimizer_is_refused() -> None:
    """One optimizer's step gathers parameters into the buffers that hold the other's gradients."""
    for message in run_distributed(second_optimizer_worker, 2, timeout=120):
        assert "supports one optimizer per model, and this model already has one (Adam)" in message


def test_a_renamed_elementwise_optimizer_is_accepted() -> None:
    from lightning_pipe.data_parallel.sharded_optimizer import ShardingError, check_shardable

    class MyAdam(torch.optim.Adam):
        """Only a new name (and a helper), the same element-wise step."""

    check_shardable(MyAdam([torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(ShardingError, match="Adafactor is not known to be"):
        check_shardable(torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(2, 2))]))


def one_replica_worker() -> tuple[list[str], str]:
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    mesh = init_mesh(ParallelLayout(1, 1, 1), "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    options = RuntimeOptions(shard_optimizer_state=True)
    runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options)
    return runtime.warnings, runtime.describe(2)


@pytest.mark.distributed
def test_sharding_with_one_replica_says_it_does_nothing() -> None:
    ((warnings, layout_log),) = run_distributed(one_replica_worker, 1)
    assert any("shard_optimizer_state=True has no effect with data_parallel_size=1" in w for w in warnings)
    assert "shard_optimizer_state=True has no effect" in layout_log


class WeightReader(L.Callback):
    """Reads weights where Lightning's glue runs between ``optimizer.step()`` and the next forward:
    the last layer's (whose gather the next forward would wait for last) and the whole state dict."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.state_dicts: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.weights.append(pl_module.layers[-1].weight.detach().clone())
        self.state_dicts.append({k: v.clone() for k, v in pl_module.state_dict().items()})


def read_worker(shard: bool) -> dict[str, Any]:
    model, reader = AdamRegressor(), WeightReader()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=1, num_microbatches=2, shard_optimizer_state=shard, bucket_cap_mb=0.0004,
        timeout=timedelta(seconds=90),
    )  # fmt: skip
    data = _data("mlp", 4, False)
    trainer = fit(model, strategy, 2, data, max_epochs=1, callbacks=[reader])
    after_fit = {n: p.detach().clone() for n, p in model.named_parameters()}
    gradients = strategy.runtime.gradients  # fit's (validate sets up a runtime of its own)
    caught = [s.gather.record.reads_caught for s in gradients.sharded.values()]
    buckets = len(gradients.reducer.shards) if gradients.reducer is not None else 0
    (validated,) = trainer.validate(model, _data("mlp", 4, False), verbose=False)
    return {
        "weights": reader.weights,
        "state_dicts": reader.state_dicts,
        "after_fit": after_fit,
        "val_loss": validated["val_loss"],
        "reads_caught": caught,
        "buckets": buckets,
    }


@pytest.mark.distributed
def test_weights_read_between_the_step_and_the_next_forward_are_the_updated_full_values() -> None:
    """The issue's must-show: under ZeRO-1 with the overlapped gather, a callback's
    ``on_train_batch_end`` (directly and through ``state_dict()``), user code after ``fit`` and
    ``trainer.validate`` right after ``fit`` see what a replicated run sees after each step."""
    sharded = run_distributed(read_worker, 2, True, timeout=300, init_group=False)
    replicated = run_distributed(read_worker, 2, False, timeout=300, init_group=False)
    for got, expected in zip(sharded, replicated, strict=True):
        assert got["buckets"] > 1
        steps = len(expected["weights"])
        assert steps == len(got["weights"]) >= 3
        # The guard waited at the callback's first read of each step (its state_dict found none pending).
        assert got["reads_caught"] == [steps]
        for k in range(steps):
            torch.testing.assert_close(got["weights"][k], expected["weights"][k], atol=1e-6, rtol=0)
            previous = got["weights"][k - 1] if k else None
            assert previous is None or not torch.equal(got["weights"][k], previous), f"step {k}: not updated"
            for name, value in expected["state_dicts"][k].items():
                torch.testing.assert_close(got["state_dicts"][k][name], value, atol=1e-6, rtol=0, msg=name)
        for name, value in expected["after_fit"].items():
            torch.testing.assert_close(got["after_fit"][name], value, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(got["val_loss"], expected["val_loss"], atol=1e-6, rtol=0)
