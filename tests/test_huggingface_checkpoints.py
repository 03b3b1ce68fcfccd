"""A Hugging Face model directory in, a Hugging Face model directory out.

``CausalLMModule(model=DIR)`` with ``PipeTPStrategy(pretrained=DIR)`` builds the model on the meta
device, each rank loading only its stage's tensors from the directory's safetensors (the prefix
``model.`` found by the strategy), trains at pp=2 x tp=2 with AdamW, a warm-up and a cosine decay,
and saves a sharded checkpoint; :func:`export_huggingface` turns that checkpoint into a directory
that ``AutoModelForCausalLM.from_pretrained`` reads, tokenizer files copied along. The exported
model's logits equal those of the same module trained on one device (loaded by
``from_pretrained``). The same directory without ``pretrained=`` is refused with the fix, and so
is an export from a checkpoint that records no config without ``config=``.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import CausalLMModule, CheckpointError, PipeTPStrategy
from lightning_pipe.huggingface import export_huggingface
from tests.distributed import run_distributed
from tests.hf_families import batches, build
from tests.trainers import fit

TOL = 1e-5
BATCH = 8
MODULE = dict(lr=1e-2, warmup_steps=1, weight_decay=0.1)
TRAIN = [{k: v[i] for k, v in b.items()} for b in batches("padded", 3, BATCH) for i in range(BATCH)]


def _save_model(directory: str, family: str = "llama") -> None:
    build(family).save_pretrained(directory)
    # Stand-ins for a tokenizer's files, which the export copies next to the weights.
    Path(directory, "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))


def _train(source: str, strategy: Any, devices: int, root: str) -> Any:
    module = CausalLMModule(source, **MODULE)
    saving = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True)
    # pipe_tp's injected DistributedSampler shuffles (data axis of size 1): one device gets it too.
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    fit(
        module,
        strategy,
        devices,
        DataLoader(TRAIN, batch_size=BATCH, sampler=sampler),
        root,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[saving],
    )
    return module


def worker(source: str, root: str) -> str:
    torch.set_num_threads(1)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        num_microbatches=2,
        pretrained=source,
        timeout=timedelta(seconds=60),
    )
    _train(source, strategy, 4, root)
    return os.path.join(root, "checkpoints", "last.ckpt")


def refused_worker(source: str) -> str:
    torch.set_num_threads(1)
    strategy = PipeTPStrategy(pipeline_parallel_size=2, timeout=timedelta(seconds=60))
    try:
        fit(CausalLMModule(source), strategy, 2, DataLoader(TRAIN, batch_size=BATCH), max_epochs=1)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_pretrained_directory_trains_and_exports_like_one_device() -> None:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        source, root, out = (os.path.join(tmp, n) for n in ("source", "root", "exported"))
        _save_model(source)
        checkpoint = run_distributed(worker, 4, source, root, timeout=300, init_group=False)[0]
        assert os.path.isdir(checkpoint)  # sharded: one file per rank
        export_huggingface(checkpoint, out)
        assert (
            Path(out, "tokenizer_config.json").read_text()
            == Path(source, "tokenizer_config.json").read_text()
        )
        exported = AutoModelForCausalLM.from_pretrained(out).eval()

        reference = _train(source, "auto", 1, os.path.join(tmp, "reference")).model.eval()
        initial = AutoModelForCausalLM.from_pretrained(source).eval()
        probe = batches("padded", 1, 4)[0]
        inputs = {k: v for k, v in probe.items() if k != "labels"}
        with torch.no_grad():
            got, expected = exported(**inputs).logits, reference(**inputs).logits
            before = initial(**inputs).logits
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
        assert (expected - before).abs().max().item() > 1e-2  # training moved the logits
        # The tie survives: one tensor in the files, shared again after loading.
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
        assert exported.config.use_cache  # trained without a cache, exported for generation


@pytest.mark.distributed
def test_weights_in_the_model_directory_need_pretrained() -> None:
    with tempfile.TemporaryDirectory() as source:
        _save_model(source)
        message = run_distributed(refused_worker, 2, source, timeout=120, init_group=False)[0]
    assert f"PipeTPStrategy(pretrained={source!r})" in message, message


def test_export_without_a_recorded_config_asks_for_one() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plain.ckpt")
        state = {f"model.{k}": v for k, v in build("llama").state_dict().items()}
        torch.save({"state_dict": state}, path)
        with pytest.raises(CheckpointError, match="--config DIR"):
            export_huggingface(path, os.path.join(tmp, "out"))
        source = os.path.join(tmp, "source")
        _save_model(source)
        exported = export_huggingface(path, os.path.join(tmp, "out"), config=source)
        assert Path(exported, "config.json").exists()
