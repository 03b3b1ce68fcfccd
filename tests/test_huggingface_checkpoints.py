"""A Hugging Face model directory in, a Hugging Face model directory out.

``CausalLMModule(model=DIR)`` with ``PipeTPStrategy(pretrained=DIR)`` builds the model on the meta
device, each rank loading only its stage's tensors from the directory's safetensors (the prefix
``model.`` found by the strategy), trains at pp=2 x tp=2 with AdamW, a warm-up and a cosine decay,
and saves a sharded checkpoint; :func:`export_huggingface` turns that checkpoint into a directory
that ``AutoModelForCausalLM.from_pretrained`` reads, tokenizer files copied along. The exported
model's logits equal those of the same module trained on one device (loaded by
``from_pretrained``), and so do ``val_loss``, ``test_loss`` and the predicted logits of validate,
test and predict run after the fit on the same Trainer. The same directory without
``pretrained=`` is refused with the fix, and so is an export from a checkpoint that records no
config without ``config=``.
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
HELD_OUT = [{k: v[i] for k, v in b.items()} for b in batches("packed", 2, BATCH) for i in range(BATCH)]


def _save_model(directory: str, family: str = "llama") -> None:
    build(family).save_pretrained(directory)
    # Stand-ins for a tokenizer's files, which the export copies next to the weights.
    Path(directory, "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))


def _train(source: str, strategy: Any, devices: int, root: str) -> tuple[CausalLMModule, dict[str, Any]]:
    """Fit, then validate, test and predict on the same module and Trainer: the module and what
    the three calls gave (``val_loss``, ``test_loss``, the predicted logits)."""
    module = CausalLMModule(source, **MODULE)
    saving = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True)
    # pipe_tp's injected DistributedSampler shuffles (data axis of size 1): one device gets it too.
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer = fit(
        module,
        strategy,
        devices,
        DataLoader(TRAIN, batch_size=BATCH, sampler=sampler),
        root,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[saving],
    )
    held_out = DataLoader(HELD_OUT, batch_size=BATCH)
    predicted = trainer.predict(module, held_out)
    return module, {
        "val_loss": trainer.validate(module, held_out, verbose=False)[0]["val_loss"],
        "test_loss": trainer.test(module, held_out, verbose=False)[0]["test_loss"],
        "predicted": [p.detach().clone() for p in predicted or []],
    }


def worker(source: str, root: str) -> tuple[str, dict[str, Any]]:
    torch.set_num_threads(1)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        num_microbatches=2,
        pretrained=source,
        timeout=timedelta(seconds=60),
    )
    _, evaluated = _train(source, strategy, 4, root)
    return os.path.join(root, "checkpoints", "last.ckpt"), evaluated


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
        results = run_distributed(worker, 4, source, root, timeout=300, init_group=False)
        checkpoint = results[0][0]
        assert os.path.isdir(checkpoint)  # sharded: one file per rank
        export_huggingface(checkpoint, out)
        assert (
            Path(out, "tokenizer_config.json").read_text()
            == Path(source, "tokenizer_config.json").read_text()
        )
        exported = AutoModelForCausalLM.from_pretrained(out).eval()

        module, expected = _train(source, "auto", 1, os.path.join(tmp, "reference"))
        assert module.model is not None
        reference = module.model.eval()
        # fit, then validate, test and predict on the same Trainer: every rank as one device.
        assert len(expected["predicted"]) == 2
        vocabulary = reference.config.vocab_size
        for rank, (_, evaluated) in enumerate(results):
            for key in ("val_loss", "test_loss"):
                assert float(evaluated[key]) == pytest.approx(float(expected[key]), abs=TOL), f"rank {rank}"
            assert len(evaluated["predicted"]) == len(expected["predicted"]), f"rank {rank}"
            for got_logits, logits in zip(evaluated["predicted"], expected["predicted"], strict=True):
                torch.testing.assert_close(got_logits, logits, atol=TOL, rtol=0, msg=f"rank {rank}")
            assert evaluated["predicted"][0].shape == (BATCH, *HELD_OUT[0]["input_ids"].shape, vocabulary)
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


def test_a_pretrained_model_starts_in_train_mode_as_under_pipe_tp() -> None:
    """``from_pretrained`` returns a model in eval mode and Lightning keeps the mode a module starts
    fit in: without ``.train()`` dropout would be off on one device and on under pipe_tp (which builds
    the model with ``from_config``, in train mode)."""
    with tempfile.TemporaryDirectory() as source:
        _save_model(source)
        module = CausalLMModule(source)
        module.configure_model()
        assert module.model is not None
        assert all(m.training for m in module.model.modules())
