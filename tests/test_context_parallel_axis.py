"""The context axis in the engine (``context_parallel_size``): training equal to one device.

Real gloo processes drive ``ParallelRuntime`` with ``RuntimeOptions(context_parallel_size=2)`` on a
mesh whose data axis holds the context groups, on right-padded batches; rank 0 trains the same
model on the whole batches in one process. Compared: every step's loss and the weights after the
last step (float64 within 1e-9, float32 within 1e-5), and the tokens each rank's decoder layers
receive in training (half the sequence: counted by a forward pre-hook).

Three launches. Two ranks: at C=2 a hand-written GPT whose attention call is the
``ring_attention`` marker and whose position embedding reads ``token_positions`` (float64 and
float32), llama (tied embeddings, grouped-query), qwen2 (grouped-query, biases) and mistral (a
sliding window); the refusals at the first training batch (a model whose attention is not the
ring, a batch without token counts, a length not divisible by 2C); a checkpoint saved at C=2
loaded at C=1 and trained one more step. Four ranks: C=2 x pp=2 (the GPT, llama, also interleaved;
qwen2 under ZB-H1, mistral under GPipe), C=2 x tp=2 (llama, and with sequence parallelism; qwen2, mistral),
dp=4 x C=2 with ZeRO-1 and recomputation (the GPT) and FSDP2 (llama). Two ranks under Lightning:
``PipeTPStrategy(context_parallel_size=2)``
fitting llama the Hugging Face way and the GPT through ``configure_pipeline``,
``pipeline_input`` and ``loss_items``. The batch cut and the option refusals run in one process.
"""

from __future__ import annotations

import re
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.context import ContextParallelError, active_shard, ring_attention, token_positions
from lightning_pipe.huggingface import CausalLMPipeline
from lightning_pipe.huggingface.outputs import IGNORE_INDEX, causal_lm_loss
from lightning_pipe.mesh import ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.batch import Microbatch
from lightning_pipe.runtime.hooks import ModelHooks
from tests import hf_families
from tests.distributed import run_distributed

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH, STEPS = 16, 16, 4, 2, 12, 4, 3


# ---------------------------------------------------------------- a hand-written GPT
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # token_positions: this rank's global positions under a context shard, else 0..n-1
        return self.tokens(ids) + self.positions(token_positions(ids.shape[1], ids.device)), mask


class Block(nn.Module):
    """Grouped-query attention whose attention call is the ``ring_attention`` marker."""

    def __init__(self, ring: bool = True) -> None:
        super().__init__()
        self.ring = ring
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.kv = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * KV_HEADS * (DIM // HEADS))
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        if self.ring:
            out = ring_attention(q, k, v, key_mask=mask.bool())
        else:  # an attention pipe_tp cannot see: refused under context parallelism
            k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.ln2(x)), mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class GPT(nn.Sequential):
    def forward(self, *args: Any) -> Any:  # the chained layers, as the forward check wants
        for layer in self:
            args = layer(*args) if isinstance(args, tuple) else layer(args)
        return args


def build_gpt(dtype: torch.dtype, ring: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(Embed(), Block(ring), Block(ring), Head()).to(dtype)


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, targets)``: right-padded rows, targets aligned with the tokens (shifted by
    the data: under context parallelism a rank's last token predicts a token another holds)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.randint(3, SEQ + 1, (BATCH,), generator=g)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    targets = F.pad(ids[:, 1:], (0, 1), value=-100).masked_fill(F.pad(mask[:, 1:], (0, 1)) == 0, -100)
    return ids, mask, targets


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the targets given (zero without any)."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum().clamp_min(1)


def gpt_hooks(items: bool = True) -> ModelHooks:
    counts = (lambda b: (b[2] != -100).sum(1)) if items else None
    return ModelHooks(pipeline_input=lambda b: (b[0], b[1]), loss_items=counts)


def gpt_head(output: torch.Tensor, microbatch: Microbatch) -> torch.Tensor:
    return gpt_loss(output, microbatch.data[2])


def gpt_reference(dtype: torch.dtype, steps: int, lr: float, momentum: float = 0.0) -> dict[str, Any]:
    model = build_gpt(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for step in range(steps):
        ids, mask, targets = gpt_batch(step)
        optimizer.zero_grad()
        loss = gpt_loss(model(ids, mask), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "last": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ---------------------------------------------------------------- Hugging Face families
QWEN2 = hf_families.Family("Qwen2Config", "Qwen2ForCausalLM")
"""Grouped-query attention with biased projections; registered with the test families only inside
this file's ranks (other tests parametrize over ``FAMILIES``)."""


def with_qwen2() -> None:
    hf_families.FAMILIES.setdefault("qwen2", QWEN2)


def hf_batch(step: int) -> dict[str, torch.Tensor]:
    """The families' padded batch (10 tokens) padded to 12, a multiple of 2C."""
    batch = hf_families.padded_batch(BATCH, seed=100 + step)
    return {
        "input_ids": F.pad(batch["input_ids"], (0, 2)),
        "attention_mask": F.pad(batch["attention_mask"], (0, 2)),
        "labels": F.pad(batch["labels"], (0, 2), value=IGNORE_INDEX),
    }


def hf_head(output: torch.Tensor, microbatch: Microbatch) -> torch.Tensor:
    # Under context parallelism the micro-batch holds shift_labels (shifted before the cut).
    return causal_lm_loss(output, None, microbatch.data["shift_labels"])


def hf_dtype(family: str) -> torch.dtype:
    return torch.float64 if hf_families.FAMILIES[family].float64 else torch.float32


def hf_reference(family: str, steps: int, lr: float) -> dict[str, Any]:
    model = hf_families.build(family, hf_dtype(family))
    return hf_families.train_reference(model, [hf_batch(s) for s in range(steps)], lr)


# ---------------------------------------------------------------- one layout's run
def train(
    model_name: str,
    dp: int,
    pp: int,
    tp: int,
    *,
    dtype: torch.dtype = torch.float64,
    lr: float = 0.5,
    steps: int = STEPS,
    momentum: float = 0.0,
    save: str | None = None,
    load: str | None = None,
    first_step: int = 0,
    ring: bool = True,
    items: bool = True,
    seq: int = SEQ,
    **more: Any,
) -> dict[str, Any]:
    """``steps`` SGD steps of ``model_name`` at ``dp x pp x tp`` with C=2 (C=1 when ``load``):
    every step's loss, the tokens the decoder layers received, the whole model on rank 0."""
    context = 1 if load else 2
    layout = ParallelLayout(dp, pp, tp, context_parallel_size=context)
    mesh = init_mesh(layout, "cpu")
    hf = model_name != "gpt"
    if hf:
        model: nn.Module = hf_families.build(model_name, hf_dtype(model_name))
        pipeline = CausalLMPipeline(model)
        sequence = bool(more.get("sequence_parallel", False))
        plan = pipeline.tensor_parallel_plan(tp, sequence_parallel=sequence).plan if tp > 1 else None
        layers, hooks = pipeline.layers(), pipeline.hooks()  # after the plan: the embedding's split
        decoders: list[nn.Module] = list(model.model.layers)
        head: Any = hf_head
    else:
        model = build_gpt(dtype, ring)
        layers, hooks, plan, decoders, head = (
            list(model),
            gpt_hooks(items),
            None,
            [model[1], model[2]],
            gpt_head,
        )
    seen: set[int] = set()
    for layer in decoders:  # the tokens each decoder layer receives in training
        layer.register_forward_pre_hook(
            lambda _, args: seen.add(args[0].shape[1]) if active_shard() else None
        )
    options = RuntimeOptions(
        num_microbatches=2,
        tensor_parallel_plan=plan,
        timeout=timedelta(seconds=60),
        context_parallel_size=context,
        **more,
    )
    runtime = ParallelRuntime(model, layers, mesh, torch.device("cpu"), options, seed=0, hooks=hooks)
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    if load:
        runtime.load_checkpoint(load, [optimizer])
    loaded = gather_model_state(model, runtime.partition, mesh) if load else None
    replicas = layout.sample_replicas
    replica = mesh.coordinates.dp_rank // context
    losses = []
    for step in range(first_step, first_step + steps):
        batch: Any = hf_batch(step) if hf else gpt_batch(step)
        if hf:
            mine: Any = {k: v.chunk(replicas)[replica] for k, v in batch.items()}
        else:
            mine = tuple(t.chunk(replicas)[replica][:, :seq] for t in batch)
        optimizer.zero_grad()
        runtime.begin_accumulation()
        result = runtime.train_batch(mine, head)
        # Every rank holds its sample replica's loss (its tokens' mean): weighted by the tokens,
        # the replicas' losses make the global batch's (every replica has as many ranks).
        tokens = float((mine["labels"][:, 1:] != IGNORE_INDEX).sum() if hf else (mine[2] != -100).sum())
        loss = torch.tensor([float(result.loss) * tokens, tokens], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(float(loss[0] / loss[1]))
        optimizer.step()
    if save:
        runtime.save_checkpoint(save, [optimizer])
    last = gather_model_state(model, runtime.partition, mesh)
    runtime.close()
    return {"losses": losses, "seen": sorted(seen), "last": last, "loaded": loaded}


def gaps(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Largest differences of losses and last weights (rank 0: the whole model)."""
    return {
        "loss": max(abs(a - b) for a, b in zip(run["losses"], reference["losses"], strict=True)),
        "weights": max(float((run["last"][k] - reference["last"][k]).abs().max()) for k in reference["last"]),
        "seen": run["seen"],
    }


def two_ranks(root: str) -> dict[str, Any]:
    """C=2 (dp=2, world 2): the GPT in float64 and float32, llama, qwen2, mistral; a checkpoint
    saved at C=2 loaded at C=1 (pp=2)."""
    with_qwen2()
    out: dict[str, Any] = {}
    for dtype, name, lr in ((torch.float64, "gpt64", 0.5), (torch.float32, "gpt32", 0.1)):
        run = train("gpt", 2, 1, 1, dtype=dtype, lr=lr)
        out[name] = gaps(run, gpt_reference(dtype, STEPS, lr)) if dist.get_rank() == 0 else run["seen"]
    for family in ("llama", "qwen2", "mistral"):
        lr = 0.5 if hf_families.FAMILIES[family].float64 else 0.1
        run = train(family, 2, 1, 1, lr=lr)
        out[family] = gaps(run, hf_reference(family, STEPS, lr)) if dist.get_rank() == 0 else run["seen"]
    # refusals, each on every rank at the first training batch, before any optimizer step
    for name, kwargs in (
        ("no_ring", {"ring": False}),
        ("no_items", {"items": False}),
        ("length", {"seq": 10}),
    ):
        try:
            train("gpt", 2, 1, 1, steps=1, **kwargs)
            out[name] = None
        except ContextParallelError as err:
            out[name] = str(err)
    # checkpoints: three steps at C=2 with momentum, saved; loaded at C=1 x pp=2, one more step
    path = str(Path(root) / "c2")
    saved = train("gpt", 2, 1, 1, momentum=0.9, save=path)
    resumed = train("gpt", 1, 2, 1, momentum=0.9, load=path, steps=1, first_step=STEPS)
    if dist.get_rank() == 0:
        three = gpt_reference(torch.float64, STEPS, 0.5, momentum=0.9)
        four = gpt_reference(torch.float64, STEPS + 1, 0.5, momentum=0.9)
        out["checkpoint"] = {
            "saved": max(float((saved["last"][k] - three["last"][k]).abs().max()) for k in three["last"]),
            "loaded": max(
                float((resumed["loaded"][k] - saved["last"][k]).abs().max()) for k in three["last"]
            ),
            "resumed": max(float((resumed["last"][k] - four["last"][k]).abs().max()) for k in four["last"]),
            "loss": abs(resumed["losses"][0] - four["losses"][-1]),
        }
    return out


def four_ranks() -> dict[str, Any]:
    """C=2 x pp=2 (the GPT, llama) and C=2 x tp=2 (llama), world 4; and dp=4 at C=2 (two
    context groups reading different samples) with ZeRO-1 and recomputation (the GPT) and with
    FSDP2 (llama). qwen2 (grouped-query, biases) at pp=2 under ZB-H1 and at tp=2, mistral (a
    sliding window) at pp=2 under GPipe and at tp=2."""
    with_qwen2()
    out: dict[str, Any] = {}
    for key, model_name, dp, pp, tp, more in (
        ("gpt-pp2", "gpt", 2, 2, 1, {}),
        ("llama-pp2", "llama", 2, 2, 1, {}),
        ("llama-tp2", "llama", 2, 1, 2, {}),
        ("llama-tp2-sp", "llama", 2, 1, 2, {"sequence_parallel": True}),
        ("qwen2-pp2-zb", "qwen2", 2, 2, 1, {"schedule": "zb_h1"}),
        ("llama-pp2-interleaved", "llama", 2, 2, 1, {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
        ("qwen2-tp2", "qwen2", 2, 1, 2, {}),
        ("mistral-pp2-gpipe", "mistral", 2, 2, 1, {"schedule": "gpipe"}),
        ("mistral-tp2", "mistral", 2, 1, 2, {}),
        ("gpt-dp4-zero1-recompute", "gpt", 4, 1, 1, {"shard_optimizer_state": True, "recompute": "always"}),
        ("llama-dp4-fsdp", "llama", 4, 1, 1, {"shard_parameters": True}),
    ):
        run = train(model_name, dp, pp, tp, **more)
        if dist.get_rank() == 0:
            ref = (
                gpt_reference(torch.float64, STEPS, 0.5)
                if model_name == "gpt"
                else hf_reference(model_name, STEPS, 0.5)
            )
            out[key] = gaps(run, ref)
        else:
            out[key] = run["seen"]
    return out


def _check(result: dict[str, Any], name: str, tolerance: float) -> None:
    gap = result[name]
    assert gap["loss"] < tolerance and gap["weights"] < tolerance, (name, gap)
    assert gap["seen"] == [SEQ // 2], (name, gap["seen"])  # each rank's layers: half the tokens


@pytest.mark.distributed
def test_context_parallel_at_c2_equals_one_device_and_its_checkpoint_resumes_at_c1() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(two_ranks, 2, root, timeout=600)
    rank0 = results[0]
    _check(rank0, "gpt64", 1e-9)
    _check(rank0, "gpt32", 1e-5)
    for family in ("llama", "qwen2", "mistral"):
        _check(rank0, family, 1e-9)  # all three run in float64
    assert results[1]["llama"] == [SEQ // 2]
    assert "no layer of the model called ring attention" in rank0["no_ring"], rank0["no_ring"]
    assert "weighted by token counts" in rank0["no_items"], rank0["no_items"]
    assert "sequence length is 10, not a multiple of 4" in rank0["length"], rank0["length"]
    assert "here 12" in rank0["length"]
    ckpt = rank0["checkpoint"]
    assert ckpt["saved"] < 1e-9 and ckpt["loaded"] == 0.0, ckpt
    assert ckpt["resumed"] < 1e-9 and ckpt["loss"] < 1e-9, ckpt


@pytest.mark.distributed
def test_context_parallel_composes_with_the_pipeline_and_tensor_axes() -> None:
    results = run_distributed(four_ranks, 4, timeout=600)
    for key in (
        "gpt-pp2",
        "llama-pp2",
        "llama-tp2",
        "qwen2-pp2-zb",
        "llama-pp2-interleaved",
        "qwen2-tp2",
        "mistral-pp2-gpipe",
        "mistral-tp2",
        "gpt-dp4-zero1-recompute",
        "llama-dp4-fsdp",
    ):
        _check(results[0], key, 1e-9)
        for rank in range(1, 4):  # the layers of every rank that holds some: half the tokens
            assert results[rank][key] in ([SEQ // 2], []), (key, rank, results[rank][key])
    # Sequence parallelism within each tensor group: the layers get S/C/tp = 3 tokens in training
    # (and the first batch's check runs them on S/C, with sequence parallelism suspended).
    for rank in range(4):
        assert (results[rank]["llama-tp2-sp"] if rank else results[0]["llama-tp2-sp"]["seen"]) == [
            SEQ // 4,
            SEQ // 2,
        ]
    sequence = results[0]["llama-tp2-sp"]
    assert sequence["loss"] < 1e-9 and sequence["weights"] < 1e-9, sequence


def test_a_hugging_face_batch_is_cut_with_labels_shifted_first_and_global_positions() -> None:
    from lightning_pipe.huggingface.context_cut import cut_batch

    batch = hf_batch(0)
    part, positions = cut_batch(batch, 1, 2)
    assert positions.tolist() == [3, 4, 5, 6, 7, 8]
    assert "labels" not in part and part["position_ids"].tolist() == [list(range(3, 9))] * BATCH
    assert torch.equal(part["input_ids"], batch["input_ids"][:, 3:9])
    assert torch.equal(part["attention_mask"], batch["attention_mask"][:, 3:9])
    assert torch.equal(part["shift_labels"], batch["labels"][:, 4:10])  # token t's target: t + 1


def test_context_refusals_before_any_process() -> None:
    from lightning_pipe.huggingface.context_cut import cut_batch

    with pytest.raises(ContextParallelError, match=r"sequence length is 10, not a multiple of 4.*here 12"):
        cut_batch(hf_families.padded_batch(2, seed=0), 0, 2)
    with pytest.raises(ContextParallelError, match="packs several sequences per row"):
        cut_batch({**hf_batch(0), "position_ids": torch.zeros(BATCH, SEQ, dtype=torch.long)}, 0, 2)
    with pytest.raises(ContextParallelError, match="dict with 'input_ids'"):
        cut_batch(hf_batch(0)["input_ids"], 0, 2)
    with pytest.raises(ValueError, match="context_parallel_size=2 does not divide data_parallel_size=3"):
        ParallelLayout(3, 1, 1, context_parallel_size=2)
    for other in ({"expert_parallel_size": 2}, {"partition": "time"}):
        with pytest.raises(ValueError, match="cannot be combined with"):
            RuntimeOptions(context_parallel_size=2, **other)
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_pipe import PipeTPStrategy
    from lightning_pipe.strategy.options import check_layout_fits

    with pytest.raises(ValueError, match="context_parallel_size=2 does not divide data_parallel_size=3"):
        PipeTPStrategy(data_parallel_size=3, context_parallel_size=2)
    with pytest.raises(MisconfigurationException, match="context_parallel_size=2 does not divide"):
        check_layout_fits((1, 1, "auto"), RuntimeOptions(context_parallel_size=2), 3, 1)
    layout = ParallelLayout(4, 2, 1, context_parallel_size=2)
    assert layout.context_ranks(layout.rank_of(3, 1, 0)) == [layout.rank_of(2, 1, 0), layout.rank_of(3, 1, 0)]
    assert layout.cp_rank(layout.rank_of(3, 1, 0)) == 1 and layout.sample_replicas == 2
    assert str(layout) == "dp=4 (cp=2) x pp=2 x tp=1"


def lightning_worker() -> dict[str, Any]:
    """``PipeTPStrategy(context_parallel_size=2)`` fitting llama the Hugging Face way
    (``self.model(**batch).loss``) on two processes: the whole model on rank 0, what each rank's
    sampler gave it."""
    from torch.utils.data import DataLoader

    from lightning_pipe import PipeTPStrategy
    from tests.test_huggingface_lightning import HuggingFaceStep
    from tests.trainers import fit

    torch.set_num_threads(1)
    model = HuggingFaceStep("llama")
    strategy = PipeTPStrategy(
        data_parallel_size=2,
        context_parallel_size=2,
        num_microbatches=2,
        timeout=timedelta(seconds=60),
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = fit(model, strategy, 2, DataLoader(lightning_rows(), batch_size=BATCH), root, max_epochs=1)
        # the logged values: each step's train_loss, and val_loss over two batches, on every rank
        validated = trainer.validate(
            model, DataLoader(lightning_rows(VAL_STEPS), batch_size=BATCH), verbose=False
        )
    state = gather_model_state(model, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    sampler = trainer.strategy.distributed_sampler_kwargs
    out = {"state": state, "sampler": sampler, "layout": str(trainer.strategy.mesh.layout)}
    out |= {"train_losses": model.losses, "val_loss": validated[0]["val_loss"]}
    gpt = GPTModule()
    strategy = PipeTPStrategy(
        data_parallel_size=2, context_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60)
    )
    trainer = fit(gpt, strategy, 2, DataLoader(gpt_rows(), batch_size=BATCH), max_epochs=1)
    out["gpt"] = gather_model_state(gpt, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    return out


class GPTModule(L.LightningModule):
    """The hand-written GPT the Lightning way: its layers, its batch's pipeline input and token
    counts, its own loss in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = build_gpt(torch.float32)

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.gpt)

    def pipeline_input(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[1]

    def loss_items(self, batch: Any) -> torch.Tensor:
        return (batch[2] != -100).sum(1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids, mask)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return gpt_loss(self(batch[0], batch[1]), batch[2])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gpt_rows() -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t[i] for t in gpt_batch(s)) for s in range(STEPS) for i in range(BATCH)]


def lightning_rows(steps: range = range(STEPS)) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in hf_batch(s).items()} for s in steps for i in range(BATCH)]


VAL_STEPS = range(STEPS, STEPS + 2)
"""The validation batches after the fit (new samples)."""


@pytest.mark.distributed
def test_the_strategy_option_fits_a_hugging_face_model_at_c2_like_one_device() -> None:
    from torch.utils.data import DistributedSampler

    got = run_distributed(lightning_worker, 2, timeout=300, init_group=False)
    # Lightning's training sampler shuffles (seed 0) over the dp/C = 1 sample replica: the same order.
    rows = lightning_rows()
    order = [rows[i] for i in DistributedSampler(rows, num_replicas=1, rank=0, seed=0)]
    steps = [
        {k: torch.stack([r[k] for r in order[s * BATCH : (s + 1) * BATCH]]) for k in rows[0]}
        for s in range(STEPS)
    ]
    reference = hf_families.train_reference(hf_families.build("llama"), steps, 0.5)
    gap = max(float((got[0]["state"]["model." + k] - v).abs().max()) for k, v in reference["last"].items())
    assert gap < 1e-5, gap
    # what the user's step logs is the whole sequences', on every rank: each step's train_loss and,
    # with the trained weights, val_loss (the mean of two equal batches' losses)
    for g in got:
        assert torch.allclose(
            torch.tensor(g["train_losses"]), torch.tensor(reference["losses"]), atol=1e-5, rtol=0
        )
    trained = hf_families.build("llama")
    trained.load_state_dict(reference["last"])
    with torch.no_grad():
        val = [float(hf_families.reference_loss(trained, hf_batch(s))) for s in VAL_STEPS]
    for g in got:
        assert abs(g["val_loss"] - sum(val) / len(val)) < 1e-5, (g["val_loss"], val)
    assert [g["sampler"] for g in got] == [{"num_replicas": 1, "rank": 0}] * 2
    # the hand-written GPT (configure_pipeline, pipeline_input, loss_items): one device, same order
    gpt_order = [gpt_rows()[i] for i in DistributedSampler(rows, num_replicas=1, rank=0, seed=0)]
    model = build_gpt(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(STEPS):
        ids, mask, targets = (
            torch.stack(c) for c in zip(*gpt_order[s * BATCH : (s + 1) * BATCH], strict=True)
        )
        optimizer.zero_grad()
        gpt_loss(model(ids, mask), targets).backward()
        optimizer.step()
    gap = max(float((got[0]["gpt"]["gpt." + k] - v).abs().max()) for k, v in model.state_dict().items())
    assert gap < 1e-5, gap
    assert got[0]["layout"] == "dp=2 (cp=2) x pp=1 x tp=1"


def test_a_family_the_ring_cannot_compute_is_refused_when_the_runtime_would_replace_its_attention() -> None:
    from lightning_pipe.huggingface import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"\(gemma2\) soft-caps its attention logits"):
        CausalLMPipeline(hf_families.build("gemma2")).use_ring_attention()
    dropping = hf_families.build("llama")
    dropping.config.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match=r"attention_dropout=0\.1"):
        CausalLMPipeline(dropping).use_ring_attention()
    llama = hf_families.build("llama")
    CausalLMPipeline(llama).use_ring_attention()
    assert llama.config._attn_implementation == "lightning_pipe_ring" and not llama.config.use_cache


@pytest.mark.parametrize("name", ["expert_parallel_size", "context_parallel_size"])
def test_an_option_the_mesh_was_not_laid_out_with_is_refused(name: str) -> None:
    """The axes carved from the data axis are sizes of both the options and the mesh: a runtime
    given different ones says which and how to build the mesh (one process, a group of one)."""
    from torch.distributed import HashStore

    from lightning_pipe.runtime.options import ConfigurationError

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        mesh = init_mesh(ParallelLayout(1, 1, 1), "cpu")
        model = build_gpt(torch.float32)
        options = RuntimeOptions(**{name: 2})
        message = f"{name}=2 in the options, but the mesh was laid out with {name}=1"
        with pytest.raises(
            ConfigurationError, match=re.escape(message) + r".*ParallelLayout\(\.\.\., " + name
        ):
            ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options, seed=0, hooks=gpt_hooks())
    finally:
        dist.destroy_process_group()
