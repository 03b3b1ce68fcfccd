"""Pretrained weights per stage: a meta-built model starts from files, each rank
reading only the tensors it materialises.

A tied Hugging Face Llama written with ``save_pretrained`` (one ``model.safetensors``, and sharded
with a small ``max_shard_size``) initialises pp=2 x tp=2: the gathered initial weights are the
files' exactly, and training matches one device loaded from the same files. A Lightning checkpoint
file initialises a meta-built GPT the same way. Wrong prefixes and shapes are errors naming the fix.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import CheckpointError, PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.construction.materialize import MaterializeError, materialize
from lightning_pipe.construction.meta import parameters_on_meta
from lightning_pipe.construction.pretrained import WeightFiles
from tests.distributed import run_distributed
from tests.gpt_models import LateGPT, token_data
from tests.hf_models import LlamaLM, MetaLlamaLM, llama_data
from tests.trainers import fit

TOL = 1e-5
TRAIN = llama_data(16)


class _Initial(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.state = gather_model_state(pl_module, s.runtime.partition, s.mesh)  # type: ignore[attr-defined]


def _fit(model: L.LightningModule, strategy: Any, devices: int, data: Any, **kw: Any) -> L.Trainer:
    """Two epochs in the one-device order on every layout (the sampler is given, not injected)."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    batches = DataLoader(data, batch_size=8, sampler=sampler)
    return fit(model, strategy, devices, batches, max_epochs=2, use_distributed_sampler=False, **kw)


def llama_worker(path: str) -> dict[str, Any]:
    model, initial = MetaLlamaLM(), _Initial()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2,
        timeout=timedelta(seconds=90), pretrained=path, pretrained_prefix="llama.",
    )  # fmt: skip
    _fit(model, strategy, 4, TRAIN, callbacks=[initial])
    return {
        "initial": initial.state,
        "final": gather_model_state(model, strategy.runtime.partition, strategy.mesh),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("shards", [False, True], ids=["model.safetensors", "sharded"])
def test_a_hugging_face_directory_initialises_each_stage_and_trains_like_one_device(
    tmp_path: Path, shards: bool
) -> None:
    source = LlamaLM(tied=True, seed=5)
    source.llama.save_pretrained(tmp_path, max_shard_size="8KB" if shards else "5GB")
    files = sorted(os.listdir(tmp_path))
    assert ("model.safetensors.index.json" in files) == shards, files
    got = run_distributed(llama_worker, 4, str(tmp_path), timeout=300, init_group=False)
    initial, expected = got[0]["initial"], source.state_dict()
    for key, value in expected.items():
        assert torch.equal(initial[key], value), key
    reference = LlamaLM(tied=True)
    reference.llama.load_state_dict(source.llama.state_dict())
    _fit(reference, "auto", 1, TRAIN)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[0]["final"][key], value, atol=TOL, rtol=0, msg=key)


GPT_DATA = token_data(32)


def gpt_worker(path: str) -> dict[str, Any]:
    """Start from a Lightning checkpoint file, save a sharded checkpoint after training, then start
    a fresh model from that sharded directory."""
    model, initial = LateGPT(tied=True), _Initial()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, pretrained=path)
    trainer = _fit(model, strategy, 2, GPT_DATA, callbacks=[initial])
    sharded = os.path.join(os.path.dirname(path), "sharded.ckpt")
    trainer.save_checkpoint(sharded)
    trained = gather_model_state(model, strategy.runtime.partition, strategy.mesh)
    again, second = LateGPT(tied=True), _Initial()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, pretrained=sharded)
    _fit(again, strategy, 2, GPT_DATA, callbacks=[second], max_steps=1)
    return {"initial": initial.state, "trained": trained, "from_sharded": second.state}


@pytest.mark.distributed
def test_a_lightning_file_and_a_sharded_directory_initialise_a_meta_built_model(tmp_path: Path) -> None:
    source = LateGPT(tied=True, build_now=True)
    path = tmp_path / "weights.ckpt"
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, path)
    got = run_distributed(gpt_worker, 2, str(path), timeout=300, init_group=False)
    for key, value in source.state_dict().items():
        assert torch.equal(got[0]["initial"][key], value), key
    trained, loaded = got[0]["trained"], got[0]["from_sharded"]
    assert not torch.equal(trained["layers.1.mlp.0.weight"], source.state_dict()["layers.1.mlp.0.weight"])
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key


def test_weight_files_read_each_format(tmp_path: Path) -> None:
    source = LlamaLM(seed=2)
    source.llama.save_pretrained(tmp_path / "hf")
    torch.save(source.state_dict(), tmp_path / "plain.pt")
    key = "llama.model.layers.1.mlp.up_proj.weight"
    expected = source.state_dict()[key]
    for files in (
        WeightFiles(tmp_path / "hf", prefix="llama."),
        WeightFiles(tmp_path / "hf" / "model.safetensors", prefix="llama."),
        WeightFiles(tmp_path / "plain.pt"),
    ):
        got = files.get(key)
        assert got is not None and torch.equal(got, expected), files
        assert files.get("llama.nothing.weight") is None


def test_weights_under_another_prefix_are_named_with_the_fix(tmp_path: Path) -> None:
    LlamaLM().llama.save_pretrained(tmp_path)
    with parameters_on_meta():
        model = LlamaLM()
    with pytest.raises(MaterializeError) as err:
        materialize(model, torch.device("cpu"), 0, set(), weights=WeightFiles(tmp_path))
    assert "hold no value for" in str(err.value) and "pretrained_prefix, now ''" in str(err.value)


def test_weights_of_another_shape_are_refused(tmp_path: Path) -> None:
    LlamaLM().llama.save_pretrained(tmp_path)
    with parameters_on_meta():
        model = LateGPT(build_now=True)
    bad = {"layers.0.tokens.weight": torch.zeros(3, 3)}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(MaterializeError, match=r"with shape \[3, 3\], but the model's is \[16, 16\]"):
        materialize(model, torch.device("cpu"), 0, set(), weights=WeightFiles(tmp_path / "bad.pt"))


# ------------------------------------------------------------------------ damaged and unused files
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "header":
        path.write_bytes(b"\xff" * 16 + data[16:])
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "header", "empty"])
def test_a_damaged_safetensors_file_is_named_with_the_fix(tmp_path: Path, how: str) -> None:
    LlamaLM().llama.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    _damage(file, how)
    for path in (tmp_path, file):  # the directory, and the file itself
        with pytest.raises(CheckpointError) as err:
            WeightFiles(path, prefix="llama.").get("llama.model.norm.weight")
        text = str(err.value)
        assert text.startswith(f"The pretrained weights file {file}"), text
        assert "damaged or incomplete" in text and "Copy or download it again" in text, text


def test_a_truncated_checkpoint_file_is_named_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "weights.ckpt"
    torch.save({"state_dict": LateGPT(build_now=True).state_dict()}, path)
    _damage(path, "truncated")
    with pytest.raises(CheckpointError, match=r"weights file .*weights.ckpt cannot be read as a torch ch"):
        WeightFiles(path)


def test_an_index_naming_a_missing_file_names_it(tmp_path: Path) -> None:
    LlamaLM().llama.save_pretrained(tmp_path, max_shard_size="8KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lists the files \['{shard.name}'\], which are not in"):
        WeightFiles(tmp_path)


def test_a_missing_key_names_the_file_not_its_folder(tmp_path: Path) -> None:
    source = LateGPT(build_now=True).state_dict()
    del source["layers.1.mlp.0.weight"]
    from safetensors.torch import save_file

    file = tmp_path / "only.safetensors"
    save_file({k: v.contiguous() for k, v in source.items()}, str(file))
    with parameters_on_meta():
        model = LateGPT(build_now=True)
    with pytest.raises(MaterializeError, match=rf"The pretrained weights {file} hold no value"):
        materialize(model, torch.device("cpu"), 0, set(), weights=WeightFiles(file))


def test_unused_keys_of_the_files_are_listed(tmp_path: Path) -> None:
    state = LateGPT(build_now=True).state_dict()
    extra = {**state, "layers.99.weight": torch.zeros(2), "layers.1.mlp.0.wieght": torch.zeros(2)}
    torch.save(extra, tmp_path / "extra.pt")
    files = WeightFiles(tmp_path / "extra.pt")
    assert files.unused(state.keys()) == ["layers.1.mlp.0.wieght", "layers.99.weight"]
    assert WeightFiles(tmp_path / "extra.pt", prefix="model.").unused(f"model.{k}" for k in state) == [
        "layers.1.mlp.0.wieght",
        "layers.99.weight",
    ]


def unused_worker(path: str) -> list[str]:
    model = LateGPT(build_now=False)
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, pretrained=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, strategy, 2, GPT_DATA, max_steps=1)
    return [str(w.message) for w in caught if "pretrained weights" in str(w.message)]


@pytest.mark.distributed
def test_a_misspelled_pretrained_key_is_warned_about_once(tmp_path: Path) -> None:
    state = LateGPT(build_now=True).state_dict()
    state["layers.1.mlp.0.wieght"] = state.pop("layers.1.mlp.0.weight").clone()
    state["layers.1.mlp.0.weight"] = state["layers.1.mlp.0.wieght"].clone()
    state["layers.99.weight"] = torch.zeros(2)
    torch.save({"state_dict": state}, tmp_path / "weights.ckpt")
    rank0, rank1 = run_distributed(unused_worker, 2, str(tmp_path / "weights.ckpt"), init_group=False)
    assert len(rank0) == 1 and rank1 == []  # rank 0 warns, once
    assert "hold 2 tensors that no parameter or buffer of LateGPT reads" in rank0[0]
    assert "'layers.1.mlp.0.wieght', 'layers.99.weight'" in rank0[0] and "misspelled" in rank0[0]
