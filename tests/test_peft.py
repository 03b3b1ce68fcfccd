"""LoRA with ``peft`` under pipe_tp, end to end: trained, checkpointed, exported.

A plain LightningModule wraps a tiny Qwen3 (per-head query/key norms beside its column-split
projections) with ``get_peft_model(model, LoraConfig(...))`` on every projection of attention
and MLP, and trains only the adapters with AdamW for three steps, at pp=2 x tp=2 (the LoRA layers
see-through: base layers sliced by the model's plan, ``lora_B`` of a column layer and ``lora_A``
of a row layer sliced with them), and at dp=2 x pp=2 with ZeRO-1 and with FSDP2. Each run saves
a sharded checkpoint; from it, the consolidated base weights are the initial ones bit for bit,
the adapters equal those of the same module trained on one device (1e-5), and
``export_huggingface`` writes the adapter directory, which ``PeftModel.from_pretrained`` loads on
the base model with the one-device module's logits, and the merged model, which
``AutoModelForCausalLM.from_pretrained`` loads with the same logits. The frozen base holds no
gradient and no optimizer state on any rank.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.single_file import consolidate_checkpoint
from lightning_pipe.consolidate import main as consolidate
from lightning_pipe.huggingface import export_huggingface
from lightning_pipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.distributed import run_distributed
from tests.hf_families import batches, build
from tests.trainers import fit

peft = pytest.importorskip("peft")

TOL = 1e-5
BATCH = 8  # the global batch: each of dp replicas takes BATCH // dp samples of it
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN = [{k: v[i] for k, v in b.items()} for b in batches("padded", 3, BATCH) for i in range(BATCH)]


def lora_model(dropout: float = 0.0) -> Any:
    """The tiny Qwen3 with LoRA adapters, equal in every process (``B`` drawn non-zero, so the
    adapters change the output from the first step and every slice of them is exercised)."""
    model = build("qwen3")
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


class LoraModule(L.LightningModule):
    """What a user writes: the PEFT model as ``self.model``, its loss, AdamW on what trains."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.model = lora_model(dropout)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class _EpochStates(L.Callback):
    """The module's state at the end of every training epoch (the one-device reference's)."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.states.append({k: v.detach().clone() for k, v in module.state_dict().items()})


def _train(
    strategy: Any, devices: int, root: str, batch: int, epochs: int, resume: str | None = None, *more: Any
) -> tuple[LoraModule, L.Trainer]:
    module = LoraModule()
    saving = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True)
    # pipe_tp's injected DistributedSampler shuffles: one device gets the same order.
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer = fit(
        module,
        strategy,
        devices,
        DataLoader(TRAIN, batch_size=batch, sampler=sampler),
        root,
        ckpt_path=resume,
        max_epochs=epochs,
        enable_checkpointing=True,
        callbacks=[saving, *more],
    )
    return module, trainer


def _torch_optimizer(trainer: L.Trainer) -> Any:
    """The torch optimizer that steps (ZeRO-1's holds this replica's slices as its parameters)."""
    optimizer: Any = trainer.optimizers[0]
    sharded = vars(optimizer).get("_sharded")
    return sharded.optimizer if sharded is not None else optimizer


def worker(
    root: str, pp: int, tp: int, dp: int, options: dict[str, Any], epochs: int, resume: str | None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        num_microbatches=2,
        timeout=timedelta(seconds=90),
        **options,
    )
    module, trainer = _train(strategy, pp * tp * dp, root, BATCH // dp, epochs, resume)
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    inner = _torch_optimizer(trainer)
    held = [p for group in inner.param_groups for p in group["params"]]
    sliced = [
        n
        for n, m in module.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and ".lora_" in n
    ]
    return {
        "checkpoint": os.path.join(root, "checkpoints", "last.ckpt"),
        "sliced_adapters": len(sliced),
        "frozen": len(frozen),
        "trainable_not_lora": [n for n in trainable if "lora_" not in n],
        "frozen_with_grad": [n for n, p in frozen if p.grad is not None],
        # Optimizer state elements: only the adapters' (a frozen parameter is never in a group).
        "state_elements": sum(
            t.numel() for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ),
        "optimizer_elements": sum(t.numel() for t in held),
        "lora_elements": sum(p.numel() for n, p in module.named_parameters() if "lora_" in n),
    }


def _logits(model: Any, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v for k, v in probe.items() if k != "labels"}).logits


# (name, pp, tp, dp, options): each run trains one more epoch (three steps), resuming from the
# previous run's checkpoint, saved at another layout: the adapters' tensor-parallel slices and
# AdamW's moments move into ZeRO-1's buckets, then into FSDP2's shards.
RUNS = [
    ("pp2_tp2", 2, 2, 1, {}),
    ("dp2_pp2_zero1", 2, 1, 2, {"shard_optimizer_state": True}),
    ("dp2_pp2_fsdp2", 2, 1, 2, {"shard_parameters": True}),
]


@pytest.mark.distributed
def test_lora_trains_reshards_and_exports_like_one_device(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    epochs = _EpochStates()
    with tempfile.TemporaryDirectory() as tmp:
        _train("auto", 1, tmp, BATCH, len(RUNS), None, epochs)
    initial = {f"model.{k}": v for k, v in lora_model().state_dict().items()}
    probe = batches("padded", 1, 4)[0]
    resume = None
    for epoch, (name, pp, tp, dp, options) in enumerate(RUNS, start=1):
        root = str(tmp_path / name)
        ranks = run_distributed(
            worker, pp * tp * dp, root, pp, tp, dp, options, epoch, resume, timeout=300, init_group=False
        )
        for rank in ranks:
            # Each rank's stage: two decoder layers of seven LoRA layers, one adapter side sliced each.
            assert rank["sliced_adapters"] == (2 * len(TARGETS) if tp > 1 else 0), name
            assert rank["frozen"] > 0
            assert rank["trainable_not_lora"] == [], name  # slicing kept the base frozen
            assert rank["frozen_with_grad"] == [], name
            # The optimizer holds the adapters only (ZeRO-1: a slice of them), with state for no more.
            assert 0 < rank["optimizer_elements"] <= rank["lora_elements"], name
            if options.get("shard_optimizer_state"):
                assert rank["optimizer_elements"] < rank["lora_elements"], name
            assert rank["state_elements"] == 2 * rank["optimizer_elements"], name  # AdamW's two moments
        resume = checkpoint = ranks[0]["checkpoint"]
        assert os.path.isdir(checkpoint)

        saved = consolidate_checkpoint(checkpoint, weights_only=True)["state_dict"]
        expected = epochs.states[epoch - 1]
        assert set(saved) == set(expected)
        base = [k for k in saved if "lora_" not in k]
        assert base and all(torch.equal(saved[k], initial[k]) for k in base), name  # bit for bit
        adapters = [k for k in saved if "lora_" in k]
        assert len(adapters) == 2 * len(TARGETS) * 4
        for key in adapters:
            torch.testing.assert_close(saved[key], expected[key], atol=TOL, rtol=0, msg=f"{name}: {key}")
            assert not torch.equal(saved[key], initial[key])  # trained

        reference = lora_model().eval()
        reference.load_state_dict({k[len("model.") :]: v for k, v in expected.items()})
        logits = _logits(reference, probe)
        adapter_dir, merged_dir = tmp_path / f"{name}-adapter", tmp_path / f"{name}-merged"
        export_huggingface(checkpoint, adapter_dir)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
        loaded = peft.PeftModel.from_pretrained(build("qwen3"), str(adapter_dir)).eval()
        torch.testing.assert_close(_logits(loaded, probe), logits, atol=TOL, rtol=0, msg=name)

        if epoch < len(RUNS):
            export_huggingface(checkpoint, merged_dir, merge=True)
        else:  # the command line's way
            assert consolidate([checkpoint, str(merged_dir), "--to-huggingface", "--merge"]) == 0
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(_logits(merged, probe), logits, atol=TOL, rtol=0, msg=name)


PREFIX = "model.base_model.model.model.layers.*."


def _wrapped(config: Any) -> L.LightningModule:
    module = L.LightningModule()
    module.model = peft.get_peft_model(build("qwen3"), config)
    return module


@pytest.mark.parametrize(
    ("config", "plan", "sequence", "expected"),
    [
        (
            peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True),
            {f"{PREFIX}self_attn.q_proj": "colwise"},
            False,
            "'model.base_model.model.model.layers.0.self_attn.q_proj' (PEFT Linear) uses a LoRA variant",
        ),
        (
            peft.LoraConfig(r=2, target_modules=["o_proj"]),
            {f"{PREFIX}self_attn.o_proj": "rowwise"},
            True,
            "is a LoRA layer under sequence_parallel=True, where its adapters would see this rank's part",
        ),
        (
            peft.LoraConfig(r=2, target_modules=["lm_head"]),
            {"model.base_model.model.lm_head": "colwise_logits"},
            False,
            "is given the style 'colwise_logits'; pipe_tp slices LoRA adapters with a 'colwise' or 'rowwise'",
        ),
        (
            peft.IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]),
            {f"{PREFIX}mlp.down_proj": "rowwise"},
            False,
            "(PEFT Linear) is a PEFT tuner layer other than LoRA, whose extra weights pipe_tp cannot slice",
        ),
    ],
    ids=["dora", "sequence_parallel", "logits_head", "ia3"],
)
def test_peft_layers_the_plan_cannot_slice_are_refused_naming_them(
    config: Any, plan: dict[str, str], sequence: bool, expected: str
) -> None:
    from lightning_pipe.tensor_parallel.plan import resolve_plan

    with pytest.raises(ValueError) as refusal:
        resolve_plan(_wrapped(config), plan, 2, sequence_parallel=sequence)
    assert expected in str(refusal.value)


def test_the_plan_applies_to_the_layer_lora_wraps() -> None:
    from lightning_pipe.tensor_parallel import TensorParallelStyle, resolve_plan
    from lightning_pipe.tensor_parallel.plan import lora_region_dropouts

    module = _wrapped(peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"], lora_dropout=0.1))
    plan = {f"{PREFIX}self_attn.q_proj": "colwise", f"{PREFIX}self_attn.o_proj": "rowwise"}
    resolved = resolve_plan(module, plan, 2)
    assert resolved[f"{PREFIX.replace('*', '0')}self_attn.q_proj"] is TensorParallelStyle.COLWISE
    # The dropout of a row layer's adapter sees a tensor rank's slice: its own stream, which
    # recomputation cannot replay (refused with recompute); a column layer's sees the whole input.
    assert lora_region_dropouts(module, resolved) == [
        f"model.base_model.model.model.layers.{i}.self_attn.o_proj.lora_dropout" for i in range(4)
    ]


def test_a_frozen_weight_stays_frozen_once_sliced() -> None:
    """A base layer under a LoRA adapter is frozen; its tensor-parallel slices must be too, or an
    optimizer over the trainable parameters would train the base (one process: a group of one)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import HashStore

    from lightning_pipe.tensor_parallel.layers import VocabParallelEmbedding

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        frozen, trainable = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4)
        for layer in (ColumnParallelLinear, RowParallelLinear):
            assert not any(p.requires_grad for p in layer(frozen, group).parameters())
            assert all(p.requires_grad for p in layer(trainable, group).parameters())
        embedding = nn.Embedding(4, 2).requires_grad_(False)
        assert not VocabParallelEmbedding(embedding, group).weight.requires_grad
    finally:
        dist.destroy_process_group()


def test_a_peft_model_built_on_the_meta_device_is_refused() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_pipe.strategy.pipeline_model import read_module

    with torch.device("meta"):
        module = _wrapped(peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(MisconfigurationException, match="'model' is a PEFT model built on the meta device"):
        read_module(module, True, 1, None, None)
    read_module(_wrapped(peft.LoraConfig(r=2, target_modules=["q_proj"])), True, 1, None, None)


def test_merge_needs_a_model_trained_with_adapters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_pipe import CheckpointError
    from lightning_pipe.huggingface.export import model_metadata

    model = build("qwen3")
    path = tmp_path / "plain.ckpt"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "huggingface": model_metadata(model, "model.")}, path)
    with pytest.raises(CheckpointError, match="records no PEFT adapters to merge"):
        export_huggingface(path, tmp_path / "out", merge=True)
    with pytest.raises(SystemExit):
        consolidate([str(path), str(tmp_path / "out"), "--merge"])
    assert "--merge applies to --to-huggingface" in capsys.readouterr().err


def dropout_worker() -> tuple[dict[str, torch.Tensor], str]:
    """tp=2 with LoRA dropout: the whole adapter halves (``lora_A`` of a column layer, ``lora_B`` of
    a row layer) after two steps, as this tensor rank holds them."""
    torch.set_num_threads(1)
    module = LoraModule(dropout=0.3)
    strategy = PipeTPStrategy(tensor_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=90))
    fit(module, strategy, 2, DataLoader(TRAIN[: 2 * BATCH], batch_size=BATCH), max_epochs=1)
    whole = (".self_attn.q_proj.lora_A.", ".mlp.down_proj.lora_B.")
    got = {n: p.detach().clone() for n, p in module.named_parameters() if any(w in n for w in whole)}
    # The same with the model's own gradient checkpointing on (honoured as recompute="always",
    # which cannot replay the row layer's stream): refused naming what the user turned on.
    checkpointed = LoraModule(dropout=0.3)
    checkpointed.model.gradient_checkpointing_enable()
    strategy = PipeTPStrategy(tensor_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=90))
    try:
        fit(checkpointed, strategy, 2, DataLoader(TRAIN[:BATCH], batch_size=BATCH), max_epochs=1)
    except Exception as err:
        refusal = str(err)
    else:
        refusal = "no error"
    return got, refusal


@pytest.mark.distributed
def test_lora_dropout_keeps_the_whole_adapter_halves_equal_on_the_tensor_ranks() -> None:
    """A column layer's LoRA dropout sees the replicated input and draws equal masks on the tensor
    ranks (the default generator); a row layer's sees each rank's slice and draws from the rank's
    own stream. Either way the halves kept whole get equal gradients: they must not drift apart."""
    (rank0, refusal0), (rank1, refusal1) = run_distributed(dropout_worker, 2, timeout=240, init_group=False)
    assert len(rank0) == 2 * 4 and set(rank0) == set(rank1)
    initial = dict(LoraModule().named_parameters())
    for name, value in rank0.items():
        assert torch.equal(value, rank1[name]), name
        assert not torch.equal(value, initial[name]), name  # trained
    for refusal in (refusal0, refusal1):
        assert "The model's own gradient checkpointing (gradient_checkpointing_enable()" in refusal, refusal
        assert "call gradient_checkpointing_disable(), or lora_dropout=0 in the LoraConfig" in refusal
        assert 'use recompute="never"' not in refusal  # the user chose nothing: it would not help
