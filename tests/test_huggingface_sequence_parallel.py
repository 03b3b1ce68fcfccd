"""Sequence parallelism for Hugging Face causal LMs, in one process: the plan entries derived from
the model (where the sequence is split and gathered, which modules stay whole on each rank's part),
the model plans and models that are refused by name, the masks and rotary tables built for the
whole sequence from a rank's part, and the setup check running with sequence parallelism
suspended. (Training under it: ``tp2_sp`` and ``pp2_tp2_sp`` in ``test_huggingface_families.py``.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.huggingface import CausalLMPipeline, UnsupportedModelError
from lightning_pipe.tensor_parallel import TensorParallelStyle, resolve_plan
from lightning_pipe.tensor_parallel.regions import sequence_active
from tests.hf_families import SEQ, build, packed_batch, padded_batch


def _sequence_entries(plan: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in plan.items() if v.startswith("sequence")}


def _with_plan(family: str, change: Any) -> nn.Module:
    """The family's model with its ``tp_plan`` changed by ``change``."""
    model = build(family)
    model._tp_plan = change(dict(model.tp_plan))
    return model


def test_llama_plan_gathers_at_the_split_modules_and_splits_after_its_vocab_parallel_embedding() -> None:
    model = build("llama")
    pipeline = CausalLMPipeline(model, "model")
    derived = pipeline.tensor_parallel_plan(2, sequence_parallel=True)
    assert _sequence_entries(derived.plan) == {
        "model.model.layers.*.self_attn": "sequence_gather",
        "model.model.layers.*.mlp": "sequence_gather",
        "model.model.layers.*.input_layernorm": "sequence",
        "model.model.layers.*.post_attention_layernorm": "sequence",
        "model.model.norm": "sequence",
    }
    # The vocab-parallel embedding cannot take a second style: its call splits the sequence.
    assert derived.plan["model.model.embed_tokens"] == "embedding_rowwise"
    assert derived.plan["model.lm_head"] == "colwise_gather_output"  # gathers by itself
    assert pipeline.scatter_after_embedding and pipeline.hooks().splits_sequence
    assert any(
        "sequence parallel: the sequence is split after model.model.embed_tokens" in n for n in derived.notes
    )
    # The tensor-parallel entries are those without sequence parallelism.
    without = CausalLMPipeline(build("llama"), "model").tensor_parallel_plan(2).plan
    assert {k: v for k, v in derived.plan.items() if not v.startswith("sequence")} == without
    assert _sequence_entries(without) == {}

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

    resolved = resolve_plan(Holder(), derived.plan, 2, sequence_parallel=True, split_elsewhere=True)
    assert resolved["model.model.layers.3.mlp"] is TensorParallelStyle.SEQUENCE_GATHER
    # Without the embedding call's split, the plan alone says nowhere where the sequence is split.
    with pytest.raises(ValueError, match="a 'sequence_scatter' entry"):
        resolve_plan(Holder(), derived.plan, 2, sequence_parallel=True)


def test_one_tensor_rank_derives_no_sequence_entries() -> None:
    pipeline = CausalLMPipeline(build("llama"))
    assert _sequence_entries(pipeline.tensor_parallel_plan(1, sequence_parallel=True).plan) == {}
    assert not pipeline.scatter_after_embedding


def test_gpt_neox_splits_after_its_whole_embedding_and_keeps_dropouts_on_each_part() -> None:
    # A whole embedding, whatever the installed transformers plans for it (5.24 splits GPT-NeoX's
    # embedding by the vocabulary, 5.23 did not): its own entry then splits the sequence.
    model = _with_plan("gpt_neox", lambda plan: {k: v for k, v in plan.items() if "embed_in" not in k})
    pipeline = CausalLMPipeline(model)
    derived = pipeline.tensor_parallel_plan(2, sequence_parallel=True)
    assert _sequence_entries(derived.plan) == {
        "gpt_neox.embed_in": "sequence_scatter",
        "gpt_neox.emb_dropout": "sequence",
        "gpt_neox.layers.*.input_layernorm": "sequence",
        "gpt_neox.layers.*.post_attention_layernorm": "sequence",
        "gpt_neox.layers.*.post_attention_dropout": "sequence",
        "gpt_neox.layers.*.post_mlp_dropout": "sequence",
        "gpt_neox.layers.*.attention": "sequence_gather",
        "gpt_neox.layers.*.mlp": "sequence_gather",
        "gpt_neox.final_layer_norm": "sequence",
    }
    assert not pipeline.scatter_after_embedding
    resolve_plan(model, derived.plan, 2, sequence_parallel=True)  # complete as a plan


def test_a_whole_head_gathers_the_sequence_before_it() -> None:
    model = _with_plan(
        "llama", lambda plan: {k: v for k, v in plan.items() if "embed" not in k and "lm_head" not in k}
    )
    pipeline = CausalLMPipeline(model)
    derived = pipeline.tensor_parallel_plan(2, sequence_parallel=True)
    assert derived.plan["model.embed_tokens"] == "sequence_scatter"
    assert derived.plan["lm_head"] == "sequence_gather"
    assert not pipeline.scatter_after_embedding
    resolve_plan(model, derived.plan, 2, sequence_parallel=True)


def test_per_head_norms_inside_the_gathered_attention_are_summed_there() -> None:
    model = build("qwen3")
    derived = CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)
    resolved = resolve_plan(model, derived.plan, 2, sequence_parallel=True, split_elsewhere=True)
    assert resolved["model.layers.0.self_attn"] is TensorParallelStyle.SEQUENCE_GATHER
    assert resolved["model.layers.0.self_attn.q_norm"] is TensorParallelStyle.REPLICATED_SUM


def test_sequence_parallel_entries_of_the_model_plan_mean_what_is_derived() -> None:
    derived = CausalLMPipeline(build("qwen3")).tensor_parallel_plan(2, sequence_parallel=True).plan
    named = {"model.layers.*.input_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}
    model = _with_plan("qwen3", lambda plan: {**plan, **named})
    given = CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True).plan
    assert resolve_plan(model, given, 2, True, True) == resolve_plan(model, derived, 2, True, True)
    # Without sequence parallelism they are dropped (their modules stay whole, as they would).
    plain = CausalLMPipeline(model).tensor_parallel_plan(2)
    assert _sequence_entries(plain.plan) == {} and "model.norm" not in plain.plan


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"model.layers.*.self_attn.q_norm": "sequence_parallel"},
            "'model.layers.*.self_attn.q_norm' ('sequence_parallel') names model.layers.0.self_attn.q_norm, "
            "which is inside model.layers.0.self_attn, which gathers the whole sequence",
        ),
        (
            {"model.layers.*.mlp": "sequence_parallel"},
            "'model.layers.*.mlp' ('sequence_parallel') names model.layers.0.mlp, which holds the "
            "tensor-parallel entries",
        ),
        (
            {"model.layers.*.self_attn": "sequence_gather"},
            "gives 'model.layers.*.self_attn' the style 'sequence_gather'; for a Hugging Face model pipe_tp "
            "derives where the sequence is split",
        ),
        (
            {"lm_head": "sequence_parallel", "model.embed_tokens": "sequence_parallel"},
            "the tensor-parallel plan gives the embedding model.embed_tokens the style 'sequence_parallel'",
        ),
    ],
)
def test_model_plans_that_mix_sequence_entries_inconsistently_are_refused(
    change: dict[str, str], match: str
) -> None:
    model = _with_plan("qwen3", lambda plan: {**plan, **change})
    with pytest.raises(UnsupportedModelError, match=re.escape(match)):
        CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)


def test_an_attention_whose_projections_the_plan_drops_is_refused() -> None:
    model = _with_plan(
        "llama",
        lambda plan: {k: ("packed_colwise" if k.endswith("q_proj") else v) for k, v in plan.items()},
    )
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "model.layers.0.self_attn (LlamaAttention) holds parameters and the tensor-parallel plan leaves "
            "it whole (its entries use the styles ['packed_colwise']"
        ),
    ):
        CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)
    # Without sequence parallelism it stays whole on every rank, computing the whole sequence.
    CausalLMPipeline(model).tensor_parallel_plan(2)


def test_a_mixer_that_is_neither_split_nor_a_norm_is_refused() -> None:
    model = build("llama")
    for layer in model.model.layers:  # a hybrid family's convolution mixer
        layer.mixer = nn.Conv1d(32, 32, 3)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model\.layers\.0\.mixer \(Conv1d\) holds parameters and it is neither a module the "
        r"tensor-parallel plan splits .* Use sequence_parallel=False",
    ):
        CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)


def test_mixture_of_experts_left_whole_is_refused_unless_the_plan_vouches_for_it() -> None:
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp \(MixtralSparseMoeBlock\)"):
        CausalLMPipeline(build("mixtral")).tensor_parallel_plan(2, sequence_parallel=True)
    # Its router and experts compute each token alone: the model's plan may say so.
    model = _with_plan("mixtral", lambda plan: {**plan, "model.layers.*.mlp": "sequence_parallel"})
    derived = CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)
    resolved = resolve_plan(model, derived.plan, 2, sequence_parallel=True, split_elsewhere=True)
    assert resolved["model.layers.0.mlp"] is TensorParallelStyle.SEQUENCE


def test_a_dropout_that_cannot_draw_its_part_of_the_mask_is_refused() -> None:
    model = build("llama")
    for layer in model.model.layers:
        layer.drop = nn.AlphaDropout(0.1)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.drop is a AlphaDropout with p=0\.1"):
        CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True)
    for layer in model.model.layers:
        layer.drop = nn.Dropout(0.1)  # draws its part of the whole sequence's mask
    plan = CausalLMPipeline(model).tensor_parallel_plan(2, sequence_parallel=True).plan
    assert plan["model.layers.*.drop"] == "sequence"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mistral"])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_masks_and_rotary_tables_from_a_part_of_the_sequence_are_the_whole_sequences(
    family: str, kind: str
) -> None:
    pipeline = CausalLMPipeline(build(family))
    batch = (padded_batch if kind == "padded" else packed_batch)(4, seed=3)
    _, mask, positions = pipeline.pipeline_input(batch)
    hidden = torch.randn(4, SEQ, 32)
    context = pipeline.context
    for index in range(pipeline.parts.num_layers):
        context.forget()
        whole = context(index, hidden, mask, positions)
        context.forget()
        part = context(index, hidden[:, : SEQ // 2].clone(), mask, positions)
        assert whole.keys() == part.keys()
        for key, value in whole.items():
            mine = part[key]
            if isinstance(value, tuple):
                assert all(torch.equal(a, b) for a, b in zip(value, mine, strict=True)), key
            elif isinstance(value, torch.Tensor):
                assert value.shape == mine.shape and torch.equal(value, mine), key
            else:
                assert value == mine, key
    # A whole mask has a row per query of the whole sequence.
    context.forget()
    masks = context(0, hidden[:, :5], mask, positions)["attention_mask"]
    if isinstance(masks, torch.Tensor):
        assert masks.shape[-2] == SEQ


def test_the_setup_check_runs_with_sequence_parallelism_suspended() -> None:
    model = build("llama")
    pipeline = CausalLMPipeline(model)
    seen: list[bool] = []
    for module in (model.model.embed_tokens, *model.model.layers, model.lm_head):
        module.register_forward_pre_hook(lambda *_: seen.append(sequence_active()))
    assert sequence_active()
    probe = pipeline.pipeline_input(padded_batch(2, seed=1))
    assert pipeline.check(probe, [model.lm_head]) == (None, None)
    assert seen and not any(seen)
    assert sequence_active()


def test_replicated_sum_is_accepted_inside_a_gathered_module_only() -> None:
    """Inside a ``sequence_gather`` module a ``replicated_sum`` module (a per-head norm) sees the
    whole sequence but this rank's heads: its gradient is partial and summed. Inside the
    ``sequence_scatter`` module every rank computes the whole thing: summing would multiply."""

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(8, 4)
            self.norm = nn.LayerNorm(4)

    model = nn.Sequential(Embed(), nn.LayerNorm(4))
    plan = {"0": "sequence_scatter", "1": "sequence", "0.norm": "replicated_sum"}
    with pytest.raises(
        ValueError, match=re.escape("'0.norm': 'replicated_sum' is inside '0' (sequence_scatter)")
    ):
        resolve_plan(model, plan, 2, sequence_parallel=True)


def token_mixing_worker(mix: bool) -> str:
    """llama at tp=2 under sequence parallelism, its decoder layers (``mix``) adding a running sum
    over the sequence in their own forward, outside any module: the first step's answer."""
    from datetime import timedelta

    from lightning_pipe.huggingface.outputs import causal_lm_loss
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
    from tests.hf_families import padded_batch

    model = build("llama", torch.float64)
    if mix:
        for layer in model.model.layers:
            original = layer.forward

            def forward(hidden: torch.Tensor, *args: Any, original: Any = original, **kwargs: Any) -> Any:
                out = original(hidden, *args, **kwargs)
                first = out[0] if isinstance(out, tuple) else out
                mixed = first + 0.1 * first.cumsum(dim=1)  # every token sees the ones before it
                return (mixed, *out[1:]) if isinstance(out, tuple) else mixed

            layer.forward = forward
    pipeline = CausalLMPipeline(model)
    plan = pipeline.tensor_parallel_plan(2, sequence_parallel=True)
    options = RuntimeOptions(
        num_microbatches=2,
        tensor_parallel_plan=plan.plan,
        sequence_parallel=True,
        timeout=timedelta(seconds=60),
    )
    mesh = init_mesh(ParallelLayout(1, 1, 2), "cpu")
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    try:
        runtime.train_batch(padded_batch(4, 0), lambda out, mb: causal_lm_loss(out, mb.data["labels"]))
    except Exception as err:
        return str(err)
    finally:
        runtime.close()
    return "no error"


@pytest.mark.distributed
def test_a_decoder_layer_that_mixes_tokens_outside_its_modules_is_refused_at_the_first_step() -> None:
    """What the derived plan cannot see (a layer's own forward) is checked on the first batch: each
    decoder layer on its part of the sequence, gathered, against the whole sequence."""
    from tests.distributed import run_distributed

    for message in run_distributed(token_mixing_worker, 2, True, timeout=120):
        assert "decoder layer 0 of llama (LlamaDecoderLayer) computes on each tensor rank's part" in message
        assert "Use sequence_parallel=False for this model" in message
    assert run_distributed(token_mixing_worker, 2, False, timeout=120) == ["no error", "no error"]


def test_the_whole_sequence_stand_in_keeps_the_batch_of_the_hidden_states() -> None:
    """Position ids given once for every sample (``[1, s]``, which Hugging Face accepts) must not
    shrink the stand-in's batch: the masks built from it would cover sample 0's padding only."""
    from lightning_pipe.huggingface.context import whole_sequence

    hidden = torch.randn(4, 3, 8)  # this rank's part of a 6-token sequence
    stand_in = whole_sequence(hidden, torch.arange(6).unsqueeze(0))
    assert stand_in.shape == (4, 6, 8)
    assert whole_sequence(torch.randn(4, 6, 8), torch.arange(6).unsqueeze(0)).shape == (4, 6, 8)
