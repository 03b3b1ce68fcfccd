"""A Hugging Face model's own tensor-parallel plan, unchanged.

``LlamaForCausalLM._tp_plan`` with ``tie_word_embeddings=True`` names its styles the Hugging Face
way (``colwise_gather_output`` for ``lm_head``, ``embedding_rowwise`` for the tied embedding); under
pp=2 x tp=2 the embedding (stage 0) and the head (stage 1) are sharded the same way, stay tied, and
training matches one device. Styles we do not support are refused naming the entry, and a plan
that shards one side of a tied weight only is refused naming both sides. A sliced module keeps the
mode (``training``) of the module it replaces.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaForCausalLM

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.tensor_parallel import TensorParallelStyle, resolve_plan
from tests.distributed import run_distributed
from tests.hf_models import LlamaLM, MetaLlamaLM, llama_data, tiny_config
from tests.trainers import fit

TOL = 1e-5
TRAIN = llama_data(16)


def _fit(model: LlamaLM, strategy: Any, devices: int) -> None:
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    fit(model, strategy, devices, DataLoader(TRAIN, batch_size=8, sampler=sampler), max_epochs=2)


def tied_worker() -> dict[str, Any]:
    model = LlamaLM(tied=True, hf_plan=True)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=90)
    )
    _fit(model, strategy, 4)
    head, embed = model.llama.lm_head, model.llama.model.embed_tokens
    on_last = strategy.holds_last_stage
    return {
        "state": gather_model_state(model, strategy.runtime.partition, strategy.mesh),
        "kinds": (type(embed).__name__, type(head).__name__),
        "tied_here": head.weight is embed.weight,
        "on_last": on_last,
    }


@pytest.mark.distributed
def test_a_tied_llama_with_its_own_plan_trains_like_one_device() -> None:
    got = run_distributed(tied_worker, 4, timeout=300, init_group=False)
    reference = LlamaLM(tied=True)
    _fit(reference, "auto", 1)
    assert reference.llama.lm_head.weight is reference.llama.model.embed_tokens.weight
    state, expected = got[0]["state"], reference.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=key)
    # The first stage shards the embedding, the last the head, both from the Hugging Face names.
    assert got[0]["kinds"][0] == "VocabParallelEmbedding" and got[2]["kinds"][1] == "ColumnParallelLinear"


def test_hugging_face_style_names_map_to_ours() -> None:
    model = LlamaLM(tied=True)
    plan = {f"llama.{k}": v for k, v in model.llama._tp_plan.items()}
    assert plan["llama.lm_head"] == "colwise_gather_output"
    resolved = resolve_plan(model, plan, 2)
    assert resolved["llama.lm_head"] is TensorParallelStyle.COLWISE_GATHER
    assert resolved["llama.model.embed_tokens"] is TensorParallelStyle.VOCAB
    assert resolved["llama.model.layers.0.self_attn.o_proj"] is TensorParallelStyle.ROWWISE
    split = resolve_plan(model, {"llama.model.layers.*.mlp.down_proj": "rowwise_split_input"}, 2)
    assert set(split.values()) == {TensorParallelStyle.ROWWISE_SPLIT}


@pytest.mark.parametrize(
    ("style", "advice"),
    [
        ("local_colwise", "use 'colwise'"),
        ("packed_colwise", "fused projection"),
        ("grouped_gemm", "expert parallelism"),
    ],
)
def test_unsupported_hugging_face_styles_name_the_entry(style: str, advice: str) -> None:
    model = LlamaLM()
    with pytest.raises(ValueError) as err:
        resolve_plan(model, {"llama.model.layers.*.mlp.up_proj": style}, 2)
    text = str(err.value)
    assert f"'llama.model.layers.*.mlp.up_proj': {style!r} is a Hugging Face style" in text
    assert advice in text


def test_a_plan_that_shards_one_side_of_a_tied_weight_is_refused() -> None:
    model = LlamaLM(tied=True)
    with pytest.raises(ValueError) as err:
        resolve_plan(model, {"llama.lm_head": "colwise_gather_output"}, 2)
    text = str(err.value)
    assert "'llama.lm_head' and 'llama.model.embed_tokens' share a weight (tied)" in text
    assert "shards only 'llama.lm_head'" in text
    assert "'embedding_rowwise'" in text


class _TiedRowwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.embed.weight


def test_tied_modules_sharded_along_different_dims_are_refused() -> None:
    expected = r"along dim 0 for 'embed' \(vocab\) but dim 1 for 'head' \(rowwise\)"
    with pytest.raises(ValueError, match=expected):
        resolve_plan(_TiedRowwise(), {"embed": "vocab", "head": "rowwise"}, 2)


class _Initial(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.state = gather_model_state(pl_module, s.runtime.partition, s.mesh)  # type: ignore[attr-defined]


def meta_llama_worker() -> dict[str, Any]:
    L.seed_everything(0)
    model, initial = MetaLlamaLM(), _Initial()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0)
    fit(
        model, strategy, 4, DataLoader(TRAIN, batch_size=8, sampler=sampler),
        max_epochs=2, callbacks=[initial], use_distributed_sampler=False,
    )  # fmt: skip
    assert model.llama is not None
    held = [p for p in model.llama.parameters() if not p.is_meta]
    return {
        "initial": initial.state,
        "final": gather_model_state(model, strategy.runtime.partition, strategy.mesh),
        "held": sum(p.numel() for p in held),
        "whole": sum(p.numel() for p in LlamaForCausalLM(tiny_config(tied=True)).parameters()),
    }


@pytest.mark.distributed
def test_a_meta_built_hugging_face_llama_trains_like_one_device_from_its_initial_weights() -> None:
    got = run_distributed(meta_llama_worker, 4, timeout=300, init_group=False)
    initial = got[0]["initial"]
    assert float(initial["llama.model.norm.weight"].sum()) == 32.0  # Hugging Face's init: ones
    assert torch.equal(initial["llama.lm_head.weight"], initial["llama.model.embed_tokens.weight"])
    reference = LlamaLM(tied=True)
    reference.load_state_dict(initial)
    _fit(reference, "auto", 1)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[0]["final"][key], value, atol=TOL, rtol=0, msg=key)
    assert all(r["held"] < 0.5 * r["whole"] for r in got), [(r["held"], r["whole"]) for r in got]


def modes_worker() -> dict[str, list[str]]:
    """A Hugging Face Qwen3 in eval mode (as ``from_pretrained`` gives it), a layer left in train
    mode by hand, sliced by its own plan over a fake two-rank tensor group: which modules'
    ``training`` flags differ from the unsliced model's, by name."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_pipe.huggingface.tensor_parallel import model_plan
    from lightning_pipe.tensor_parallel import apply_plan
    from tests.hf_families import build

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build("qwen3").eval()
        model.model.layers[1].train()  # a mix: each replaced module keeps its own mode
        expected = {n: m.training for n, m in model.named_modules()}
        resolved = resolve_plan(model, model_plan(model), 2)
        replaced = apply_plan(model, resolved, dist.group.WORLD, seed=0)
        differ = [n for n, m in model.named_modules() if n in expected and m.training != expected[n]]
        # A PEFT model in eval mode: a row layer's LoRA dropout is replaced by a region dropout,
        # which must stay in eval too (in train mode it would draw masks one device does not).
        import peft

        lora = peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"], lora_dropout=0.1)
        wrapped = peft.get_peft_model(build("qwen3"), lora).eval()
        expected = {n: m.training for n, m in wrapped.named_modules()}
        layers = "base_model.model.model.layers.*.self_attn"
        plan = {f"{layers}.q_proj": "colwise", f"{layers}.o_proj": "rowwise"}
        replaced += apply_plan(wrapped, resolve_plan(wrapped, plan, 2), dist.group.WORLD, seed=0)
        dropouts = [n for n, m in wrapped.named_modules() if n.endswith("o_proj.lora_dropout.default")]
        assert dropouts and all(type(wrapped.get_submodule(n)).__name__ == "RegionDropout" for n in dropouts)
        differ += [n for n, m in wrapped.named_modules() if n in expected and m.training != expected[n]]
        return {"replaced": replaced, "differ": differ}
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_sliced_module_keeps_the_mode_of_the_module_it_replaces() -> None:
    (got,) = run_distributed(modes_worker, 1, timeout=120, init_group=False)
    assert any(n.endswith("self_attn.q_proj") for n in got["replaced"]), got["replaced"]
    assert got["differ"] == [], got["differ"]
