"""Tensor parallelism in the flows users run, on a Hugging Face Llama cut into pipeline wrappers:

* the plan names modules by their Hugging Face names (``llama.model.layers.*``), the pipeline holds
  them under other names (``pipe.*.layer``): they are sharded all the same, and each rank holds
  fewer parameter elements than the unsharded model;
* fit, then validate and predict on the same model and Trainer, then fit again from a checkpoint
  with a new Trainer: every call reuses the sharded model and all numbers equal one device's;
* without a seed, the tensor ranks start from the same weights (one device started from the
  gathered initial weights ends where the run ends);
* a later call with another layout is refused, naming the fix.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim
from lightning_pipe.tensor_parallel.plan import resolve_plan
from lightning_pipe.tensor_parallel.stage import count_slicing
from tests.distributed import run_distributed
from tests.hf_models import LlamaLM, llama_data
from tests.trainers import fit, quiet_trainer

TOL = 1e-5
TRAIN, VAL = llama_data(16), llama_data(8, seed=4)


def _loaders(reference: bool) -> tuple[DataLoader, DataLoader]:
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if reference else None
    return DataLoader(TRAIN, batch_size=8, sampler=sampler), DataLoader(VAL, batch_size=4)


def _strategy(pp: int, tp: int) -> Any:
    return PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2, timeout=timedelta(seconds=90)
    )


def _flow(model: LlamaLM, make_strategy: Any, devices: int, root: str) -> dict[str, Any]:
    """fit one epoch, save, validate, predict; then a new Trainer resumes the fit for one more."""
    train, val = _loaders(reference=devices == 1)
    trainer = fit(model, make_strategy(), devices, train, root, max_epochs=1, num_sanity_val_steps=0)
    path = os.path.join(root, "epoch1.ckpt")
    trainer.save_checkpoint(path)
    validated = trainer.validate(model, val, verbose=False)[0]
    predictions = torch.cat(trainer.predict(model, val))  # type: ignore[arg-type]
    again = fit(model, make_strategy(), devices, train, root, path, max_epochs=2, num_sanity_val_steps=0)
    return {"val_loss": validated["val_loss"], "predictions": predictions, "trainer": again}


def llama_worker(pp: int, tp: int, root: str) -> dict[str, Any]:
    model = LlamaLM()
    unsharded = sum(p.numel() for p in model.parameters())
    result = _flow(model, lambda: _strategy(pp, tp), pp * tp, os.path.join(root, f"r{os.environ['RANK']}"))
    strategy = result.pop("trainer").strategy
    own = [model.pipe[i] for i in strategy.runtime.partition.layer_range(strategy.pp_rank)]
    result.update(
        state=gather_model_state(model, strategy.runtime.partition, strategy.mesh),
        elements=sum(p.numel() for p in model.parameters()),
        own_elements=sum(p.numel() for layer in own for p in layer.parameters()),
        unsharded=unsharded,
        sharded=sum(1 for p in model.parameters() if tensor_parallel_dim(p) is not None),
    )
    return result


@pytest.mark.distributed
@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 2)], ids=["tp2", "pp2xtp2"])
def test_llama_calls_reuse_the_sharded_model_and_match_one_device(pp: int, tp: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(llama_worker, pp * tp, pp, tp, root, timeout=300, init_group=False)
        reference_model = LlamaLM()
        ref = _flow(reference_model, lambda: "auto", 1, os.path.join(root, "ref"))
    ref_state = reference_model.state_dict()
    for rank, result in enumerate(got):
        # The plan reached the Hugging Face modules through the pipeline wrappers.
        assert result["sharded"] > 0, f"rank {rank}: nothing was sharded"
        assert result["elements"] < result["unsharded"], f"rank {rank}"
        assert result["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL), f"rank {rank}"
        torch.testing.assert_close(result["predictions"], ref["predictions"], atol=TOL, rtol=0)
    # Each rank's own stage holds 1/tp of the sharded projections: well under a full stage.
    full_stage = result["unsharded"] / pp
    assert all(r["own_elements"] < 0.75 * full_stage for r in got)
    state = got[0]["state"]
    assert state.keys() == ref_state.keys()
    for key, expected in ref_state.items():
        torch.testing.assert_close(state[key], expected, atol=TOL, rtol=0, msg=key)


class _InitialState(L.Callback):
    """Gathers the whole model's weights right after setup (before the first step)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.state = gather_model_state(pl_module, s.runtime.partition, s.mesh)  # type: ignore[attr-defined]


def unseeded_worker(root: str) -> dict[str, Any]:
    model = LlamaLM(seed=None)  # every rank draws its own weights
    initial = _InitialState()
    train, _ = _loaders(reference=False)
    trainer = fit(
        model, _strategy(1, 2), 2, train, root, max_epochs=2, num_sanity_val_steps=0, callbacks=[initial]
    )
    strategy = trainer.strategy
    replicated = {
        n: p.detach().clone() for n, p in model.named_parameters() if tensor_parallel_dim(p) is None
    }
    return {
        "initial": initial.state,
        "final": gather_model_state(model, strategy.runtime.partition, strategy.mesh),  # type: ignore[attr-defined]
        "replicated": replicated,
    }


@pytest.mark.distributed
def test_unseeded_tensor_ranks_start_from_one_model() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(unseeded_worker, 2, root, timeout=300, init_group=False)
        for name, value in got[0]["replicated"].items():  # embeddings, norms: the same on both ranks
            torch.testing.assert_close(got[1]["replicated"][name], value, atol=0, rtol=0, msg=name)
        reference = LlamaLM(seed=None)
        reference.load_state_dict(got[0]["initial"])
        fit(reference, "auto", 1, _loaders(reference=True)[0], root, max_epochs=2, num_sanity_val_steps=0)
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(got[0]["final"][key], expected, atol=TOL, rtol=0, msg=key)


def layout_change_worker(root: str) -> str:
    model = LlamaLM()
    train, val = _loaders(reference=False)
    fit(model, _strategy(1, 2), 2, train, root, max_epochs=1, num_sanity_val_steps=0)
    try:
        quiet_trainer(_strategy(2, 1), 2, root, max_epochs=1, num_sanity_val_steps=0).validate(
            model, val, verbose=False
        )
    except MisconfigurationException as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_later_call_with_another_layout_is_refused() -> None:
    with tempfile.TemporaryDirectory() as root:
        messages = run_distributed(layout_change_worker, 2, root, timeout=200, init_group=False)
    for message in messages:
        assert "LlamaLM was already split for the pipe_tp layout dp=1 x pp=1 x tp=2" in message
        assert "this call asks for dp=1 x pp=2 x tp=1" in message
        assert "load it into a freshly built model under the new layout" in message


class _Outside(LlamaLM):
    """A plan that names only a module no pipeline layer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(32, 32).requires_grad_(False)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"spare": "colwise"}


def test_a_plan_that_shards_nothing_is_an_error() -> None:
    model = _Outside()
    layers = model.configure_pipeline()
    resolved = resolve_plan(model, model.tensor_parallel_plan(), 2)
    with pytest.raises(
        ValueError, match=r"matches 1 modules \(e\.g\. \['spare'\]\), but none of them is inside"
    ):
        count_slicing(model, resolved, layers, [0] * len(layers), 1)


def test_plan_is_resolved_by_identity_and_counted_per_stage() -> None:
    model = LlamaLM()
    resolved = resolve_plan(model, model.tensor_parallel_plan(), 2)
    # 7 projections per decoder layer, each named once (by its first, Hugging Face name).
    assert len(resolved) == 14 and all(name.startswith("llama.model.layers.") for name in resolved)
    layers = model.configure_pipeline()
    counts = count_slicing(model, resolved, layers, [0, 0, 1, 1], 2)
    per_layer = sum(p.numel() for p in model.llama.model.layers[0].parameters() if p.dim() == 2)
    assert counts.modules == (7, 7) and counts.elements == (per_layer, per_layer)
    # Reached through the pipeline wrappers, the same modules resolve to the same names.
    pipe_plan = {"pipe.*.layer.mlp.up_proj": "colwise"}
    assert list(resolve_plan(model, pipe_plan, 2)) == [f"llama.model.layers.{i}.mlp.up_proj" for i in (0, 1)]
