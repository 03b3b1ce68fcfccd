"""Models built without storage: in ``configure_model()`` or under
``trainer.init_module(empty_init=True)``, each rank materialises only its own stage and tensor
slice, with initial weights that do not depend on the layout, and trains like one device.

For each layout (pp=2, pp=4, pp=2 x tp=2, dp=2 x pp=2) the whole model's initial weights are
gathered before the first step and must be bit-identical to one pipe_tp process's; the weights
after two epochs must equal one device's (``strategy="auto"``, started from those initial
weights) within 1e-5. Each rank reports what it holds: other stages' parameters are meta tensors
(no storage) and a tensor-parallel parameter's storage is its slice, never the full tensor.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as LightningSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.construction.meta import ValueLostError, parameters_on_meta
from lightning_pipe.strategy.summary import PipelineModelSummary
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from tests.distributed import run_distributed, run_distributed_outcomes
from tests.gpt_models import LateGPT, token_data
from tests.trainers import fit, quiet_trainer

TOL = 1e-5
DATA = token_data(32)
SEED = 1234


class Snapshot(L.Callback):
    """Gathers the whole model's weights (on rank 0) before the first step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.initial = gather_model_state(pl_module, s.runtime.partition, s.mesh)  # type: ignore[attr-defined]
        self.local = {
            n: p.detach().clone() for n, p in pl_module.named_parameters() if not p.is_meta
        }  # what this rank holds, before any step
        self.sharded = {n for n, p in pl_module.named_parameters() if tensor_parallel_dim(p) is not None}


def _holdings(model: LateGPT, strategy: PipeTPStrategy) -> dict[str, Any]:
    """What this rank holds: per layer, whether its parameters have storage; per tensor-parallel
    parameter, whether its storage is exactly its slice."""
    own = set(strategy.runtime.partition.layer_range(strategy.pp_rank))  # type: ignore[union-attr]
    assert model.layers is not None
    owned_ids = {id(p) for i in own for p in model.layers[i].parameters()}
    layers = {
        i: sorted({p.is_meta for p in layer.parameters() if id(p) not in owned_ids or i in own})
        for i, layer in enumerate(model.layers)
    }
    slices = {
        n: p.untyped_storage().nbytes() == p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not p.is_meta and tensor_parallel_dim(p) is not None
    }
    # The optimizer (built from self.parameters()) holds exactly this rank's parameters.
    held = [p for opt in strategy.optimizers for g in opt.param_groups for p in g["params"]]
    in_optimizer = {id(p) for p in held}
    return {
        "own": sorted(own), "layers": layers, "slices": slices,
        "optimizer_is_own": in_optimizer == owned_ids and len(held) == len(in_optimizer),
    }  # fmt: skip


def worker(pp: int, tp: int, dp: int, seeded: bool, how: str, tied: bool) -> dict[str, Any]:
    if seeded:
        L.seed_everything(SEED)
    else:  # an earlier test may have left Lightning's seed in the environment the ranks inherit
        os.environ.pop("PL_GLOBAL_SEED", None)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2,
        timeout=timedelta(seconds=90),
    )  # fmt: skip
    snapshot = Snapshot()
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(
            strategy, pp * tp * dp, root, max_epochs=2, enable_model_summary=True,  # the summary is checked
            callbacks=[snapshot, ModelSummary(max_depth=2)],
        )  # fmt: skip
        if how == "init_module":
            with trainer.init_module(empty_init=True):
                model = LateGPT(tied, build_now=True)
            assert model.layers is not None and model.layers[1].mlp[0].weight.is_meta
        elif how == "eager":  # built whole on every rank, as models without configure_model() are
            model = LateGPT(tied, build_now=True)
        else:
            model = LateGPT(tied)
        trainer.fit(model, DataLoader(DATA, batch_size=8 // dp))
    final = gather_model_state(model, strategy.runtime.partition, strategy.mesh)
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]  # type: ignore[attr-defined]
    summary = callback._summary(trainer, model)  # what the callback printed on rank 0
    assert isinstance(summary, PipelineModelSummary)
    return {
        "initial": snapshot.initial, "final": final, "coords": strategy.mesh.coordinates,
        "local_initial": snapshot.local, "sharded": snapshot.sharded,
        "summary": (summary.layer_names, summary.param_nums, summary.total_parameters,
                    dict(summary._get_summary_data())["Params per Device"]),
        **_holdings(model, strategy),
    }  # fmt: skip


def _one_device(initial: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    model = LateGPT(tied, build_now=True)
    model.load_state_dict(initial)
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=SEED)  # what Lightning injects
    fit(model, "auto", 1, DataLoader(DATA, batch_size=8, sampler=sampler), max_epochs=2)
    return model.state_dict()


_single: dict[bool, dict[str, torch.Tensor]] = {}


def _single_process_initial(tied: bool) -> dict[str, torch.Tensor]:
    """One pipe_tp process's initial weights (the layout every other must reproduce)."""
    if tied not in _single:
        args = (1, 1, 1, True, "configure_model", tied)
        (got,) = run_distributed(worker, 1, *args, timeout=120, init_group=False)
        _single[tied] = got["initial"]
    return _single[tied]


LAYOUTS = [
    pytest.param(2, 1, 1, "configure_model", False, id="pp2"),
    pytest.param(4, 1, 1, "configure_model", True, id="pp4-tied"),
    pytest.param(2, 2, 1, "init_module", True, id="pp2xtp2-tied-init_module"),
    pytest.param(2, 1, 2, "init_module", False, id="dp2xpp2-init_module"),
    pytest.param(2, 2, 1, "eager", True, id="pp2xtp2-tied-eager"),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("pp", "tp", "dp", "how", "tied"), LAYOUTS)
def test_meta_built_model_holds_its_stage_starts_layout_independent_and_matches_one_device(
    pp: int, tp: int, dp: int, how: str, tied: bool
) -> None:
    got = run_distributed(worker, pp * tp * dp, pp, tp, dp, True, how, tied, timeout=300, init_group=False)
    initial = got[0]["initial"]
    if how == "eager":  # every rank holds the whole model; it must still train like one device
        reference = _one_device(initial, tied)
        for key, value in reference.items():
            torch.testing.assert_close(got[0]["final"][key], value, atol=TOL, rtol=0, msg=key)
        assert all(r["optimizer_is_own"] for r in got)
        return
    expected = _single_process_initial(tied)
    assert initial.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(initial[key], value), f"initial {key} differs from one process's"
    reference = _one_device(expected, tied)
    for key, value in reference.items():
        torch.testing.assert_close(got[0]["final"][key], value, atol=TOL, rtol=0, msg=key)
    _check_summary(got, tied)
    for rank, result in enumerate(got):
        for index, kinds in result["layers"].items():
            # Owned layers have storage; other stages' parameters are meta (no storage).
            assert kinds == ([False] if index in result["own"] else [True]), (rank, index, kinds)
        if tp > 1:
            assert result["slices"] and all(result["slices"].values()), (rank, result["slices"])
        assert result["optimizer_is_own"], rank


def _check_summary(got: list[dict[str, Any]], tied: bool) -> None:
    """The model summary counts the whole model as one device's does, and for each layer the
    elements one rank of its stage holds (a tensor slice under tensor parallelism)."""
    names, counts, total, per_device = got[0]["summary"]
    one_device = LightningSummary(LateGPT(tied, build_now=True), max_depth=2)
    assert names == one_device.layer_names and counts == one_device.param_nums
    assert total == one_device.total_parameters
    for row, name in enumerate(names):
        if name.count(".") != 1:  # a pipeline layer: layers.<i>
            continue
        index = int(name.split(".")[1])
        holder = next(r for r in got if index in r["own"])
        stage = holder["coords"].pp_rank
        held = sum(t.numel() for n, t in holder["local_initial"].items() if n.startswith(f"{name}."))
        tied_elsewhere = tied and index == 3  # the head's weight is the embedding's, named there
        if tied_elsewhere:
            held += holder["local_initial"]["layers.0.tokens.weight"].numel()
        assert per_device[row] == f"{get_human_readable_count(held)} (stage {stage})", (name, per_device[row])


@pytest.mark.distributed
def test_without_a_seed_tensor_and_data_parallel_peers_start_equal() -> None:
    """dp=2 x tp=2 without seed_everything: each process has its own default seed, yet every rank
    starts from rank 0's stream: data-parallel peers hold identical tensors, tensor-parallel peers
    identical replicated ones (the row-parallel biases are random, so this can fail)."""
    got = run_distributed(worker, 4, 1, 2, 2, False, "configure_model", False, timeout=300, init_group=False)
    by_tp: dict[int, list[dict[str, torch.Tensor]]] = {}
    for result in got:
        by_tp.setdefault(result["coords"].tp_rank, []).append(result["local_initial"])
    sharded = got[0]["sharded"]
    assert "layers.0.tokens.weight" in sharded
    for peers in by_tp.values():  # dp peers: everything equal
        assert len(peers) == 2 and peers[0].keys() == peers[1].keys()
        for name, value in peers[0].items():
            assert torch.equal(peers[1][name], value), name
    replicated = [{n: v for n, v in by_tp[t][0].items() if n not in sharded} for t in sorted(by_tp)]
    assert any("proj.bias" in n for n in replicated[0])
    for name, value in replicated[0].items():
        assert torch.equal(replicated[1][name], value), name


class NoReset(nn.Module):
    """A layer whose parameter no reset_parameters() initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Unresettable(L.LightningModule):
    def configure_model(self) -> None:
        self.layers = nn.Sequential(nn.Linear(4, 4), NoReset())

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def unresettable_worker() -> None:
    strategy = PipeTPStrategy(pipeline_parallel_size=2, timeout=timedelta(seconds=60))
    data = DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 4)), batch_size=4)
    fit(Unresettable(), strategy, 2, data, max_steps=1)


@pytest.mark.distributed
def test_a_parameter_without_initialisation_is_named_at_setup() -> None:
    outcomes = run_distributed_outcomes(unresettable_worker, 2, timeout=120, init_group=False)
    last = outcomes[1]
    assert last.exitcode == 1 and not last.killed, last
    error = last.error or ""
    assert "The meta-built model has 1 tensor that no initialisation set: ['layers.1.scale']" in error
    assert "init_module_weights(self, module)" in error


def roundtrip_worker(root: str) -> dict[str, Any]:
    """Fit a meta-built model at pp=2 x tp=2, save a sharded checkpoint; a fresh meta-built model
    validated from it holds the same weights, its consolidation is the same whole model, and a
    meta-built model at pp=4 resumes from it (another layout) and trains on."""
    L.seed_everything(SEED)

    def trainer(pp: int = 2, tp: int = 2, **kw: Any) -> L.Trainer:
        strategy = PipeTPStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2)
        return quiet_trainer(strategy, 4, root, **kw)

    data = DataLoader(DATA, batch_size=8)
    first, model = trainer(max_epochs=1), LateGPT(tied=True)
    first.fit(model, data)
    path = os.path.join(root, "meta.ckpt")
    first.save_checkpoint(path)
    saved = gather_model_state(model, first.strategy.runtime.partition, first.strategy.mesh)  # type: ignore[attr-defined]
    second, fresh = trainer(), LateGPT(tied=True)
    second.validate(fresh, data, ckpt_path=path, verbose=False)
    loaded = gather_model_state(fresh, second.strategy.runtime.partition, second.strategy.mesh)  # type: ignore[attr-defined]
    consolidated = None
    if first.is_global_zero:  # one process, no torch.distributed: what a user runs for inference
        consolidate_checkpoint(path, os.path.join(root, "whole.ckpt"))
        consolidated = torch.load(os.path.join(root, "whole.ckpt"), weights_only=True)["state_dict"]
    third, resumed = trainer(pp=4, tp=1, max_epochs=2), LateGPT(tied=True)  # another layout
    third.fit(resumed, data, ckpt_path=path)
    return {"saved": saved, "loaded": loaded, "steps": third.global_step, "consolidated": consolidated}


@pytest.mark.distributed
def test_a_meta_built_model_saves_loads_and_resumes() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(roundtrip_worker, 4, root, timeout=300, init_group=False)
    saved, loaded, consolidated = got[0]["saved"], got[0]["loaded"], got[0]["consolidated"]
    assert saved.keys() == loaded.keys() == consolidated.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
        assert torch.equal(consolidated[key], value), key
    assert [r["steps"] for r in got] == [8] * 4  # 4 batches per epoch, resumed after the first


def test_a_parameter_registered_twice_stays_one_tensor() -> None:
    with parameters_on_meta():
        shared = nn.Parameter(torch.empty(4, 4))
        a, b = nn.Module(), nn.Module()
        a.w, b.w = shared, shared
    assert a.w.is_meta and a.w is b.w


def test_loading_weights_into_meta_parameters_is_refused_not_lost(tmp_path: Any) -> None:
    """``from_pretrained`` inside configure_model() would assign values to meta parameters, which
    would be silently lost (each rank re-initialises its stage): it is an error that says so."""
    from tests.hf_models import LlamaLM

    LlamaLM().llama.save_pretrained(tmp_path)
    with pytest.raises(ValueLostError) as err, parameters_on_meta("configure_model() under pipe_tp"):
        LlamaLM().llama.from_pretrained(tmp_path)
    assert "configure_model() under pipe_tp creates parameters on the meta device" in str(err.value)
    assert "from_pretrained" in str(err.value) and "from_config" in str(err.value)
