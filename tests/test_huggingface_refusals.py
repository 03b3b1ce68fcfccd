"""What ``pipe_tp`` refuses about a Hugging Face model, and how the derived pieces behave, in one
process: models without a pipeline plan or with a loss the pipeline does not carry, a forward the
derived pipeline would not reproduce (caught by the setup check), a call inside the step that asks
for something the pipeline did not run, the tokens each sample's loss averages over, and a plan
whose heads do not split."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from lightning_pipe.huggingface import (
    CausalLMPipeline,
    ModelCall,
    ModelCallError,
    UnsupportedModelError,
    causal_lm_loss,
    causal_lm_parts,
)
from tests.hf_families import build, config, packed_batch, padded_batch


def test_a_model_without_a_pipeline_plan_names_the_fix() -> None:
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32)
    )
    with pytest.raises(UnsupportedModelError, match=r"no pipeline plan .* configure_pipeline\(\)"):
        causal_lm_parts(gpt2)


def test_an_older_transformers_is_named_with_the_upgrade(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    # The module as imported now (transformers' lazy module replaces itself in sys.modules).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.6")
    with pytest.raises(UnsupportedModelError, match=r"transformers >= 5.5; this environment has 4.57.6"):
        causal_lm_parts(model)


def test_not_a_causal_lm() -> None:
    with pytest.raises(UnsupportedModelError, match="not a Hugging Face causal language model"):
        causal_lm_parts(torch.nn.Linear(2, 2))


def test_router_loss_is_carried_not_refused() -> None:
    """The load-balancing loss is carried along the pipeline (tests/test_huggingface_balancing.py);
    what cannot be reproduced of it is refused there."""
    made = config("mixtral")
    made.output_router_logits = True
    pipeline = CausalLMPipeline(transformers.MixtralForCausalLM(made))
    assert pipeline.balancing is not None and pipeline.balancing.num_experts == made.num_local_experts


def test_heads_that_do_not_split_over_the_tensor_ranks() -> None:
    pipeline = CausalLMPipeline(build("llama"), "model")
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=4 .* tensor_parallel_size=3"):
        pipeline.tensor_parallel_plan(3)
    plan = pipeline.tensor_parallel_plan(2).plan
    # Names inside the LightningModule (prefixed), and the tied embedding/head kept together.
    assert all(key.startswith("model.") for key in plan)
    assert ("model.model.embed_tokens" in plan) == ("model.lm_head" in plan)


def _probe(pipeline: CausalLMPipeline) -> Any:
    return pipeline.pipeline_input(padded_batch(3, seed=5))


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere2", "gpt_neox"])
def test_the_setup_check_passes_for_the_model_as_it_is(family: str) -> None:
    model = build(family)
    pipeline = CausalLMPipeline(model)
    assert pipeline.check(_probe(pipeline), own_layers=pipeline.layers()) == (None, None)


def test_the_setup_check_catches_a_base_forward_that_differs() -> None:
    """A model whose forward shifts the positions before its layers: the rotary tables the
    pipeline rebuilds would not be those the model uses."""
    model = build("llama")
    base = model.model
    own = type(base).forward

    def shifted(*args: Any, position_ids: torch.Tensor, **kwargs: Any) -> Any:
        return own(base, *args, position_ids=position_ids + 1, **kwargs)

    base.forward = shifted
    pipeline = CausalLMPipeline(model)
    error, _ = pipeline.check(_probe(pipeline), own_layers=pipeline.layers()[:1])
    assert error is not None and "position_embeddings" in error and "configure_pipeline()" in error, error


def test_the_setup_check_catches_a_head_epilogue_it_does_not_know() -> None:
    class Doubled(transformers.LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    model = Doubled(config("llama"))
    pipeline = CausalLMPipeline(model)
    probe = _probe(pipeline)
    layers = pipeline.layers()
    # Only the rank holding lm_head compares the logits.
    assert pipeline.check(probe, own_layers=layers[:1]) == (None, None)
    error, _ = pipeline.check(probe, own_layers=layers[-1:])
    assert error is not None and "logits differ" in error, error


def test_loss_items_are_the_predicted_tokens_of_each_sample() -> None:
    pipeline = CausalLMPipeline(build("llama"))
    labels = torch.tensor([[5, 6, 7, -100], [5, -100, 7, 8], [-100, -100, -100, -100]])
    items = pipeline.loss_items({"input_ids": labels.clamp(min=0), "labels": labels})
    assert items.tolist() == [2, 2, 0]  # the first label is never a target (shifted by one)
    assert pipeline.loss_items({"input_ids": labels.clamp(min=0)}) is None


def _call(family: str = "llama") -> tuple[ModelCall, dict[str, torch.Tensor], torch.Tensor]:
    pipeline = CausalLMPipeline(build(family), "model")
    batch = padded_batch(3, seed=6)
    logits = torch.randn(3, batch["input_ids"].shape[1], 96)
    items = float(pipeline.loss_items(batch).sum())  # what the runtime weighted the micro-batch by
    return ModelCall(pipeline, batch, logits, items), batch, logits


def test_the_model_call_in_the_step_returns_the_pipeline_logits_and_loss() -> None:
    call, batch, logits = _call()
    out = call(**batch)
    assert out.logits is logits
    torch.testing.assert_close(out.loss, causal_lm_loss(logits, batch["labels"]))
    # Hugging Face's own loss of the same logits (labels shifted, -100 ignored, mean over tokens).
    theirs = transformers.loss.loss_utils.ForCausalLMLoss(logits, batch["labels"], vocab_size=96)
    torch.testing.assert_close(out.loss, theirs)
    assert call(batch["input_ids"], batch["attention_mask"]).loss is None  # positional, no labels


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda b: {**b, "attention_mask": torch.ones_like(b["attention_mask"])}, "with another one"),
        (lambda b: {k: v for k, v in b.items() if k != "attention_mask"}, "without one"),
        (lambda b: {**b, "input_ids": b["input_ids"].flip(0)}, "micro-batch's input_ids"),
        (lambda b: {**b, "position_ids": torch.zeros_like(b["input_ids"])}, "position_ids="),
        (lambda b: {**b, "num_items_in_batch": 7}, "num_items_in_batch"),
        (lambda b: {**b, "logits_to_keep": 1}, "logits_to_keep=1"),
        (lambda b: {**b, "use_cache": False, "bogus_kw": None}, None),
    ],
)
def test_a_model_call_that_asks_for_something_else_is_refused(change: Any, match: str | None) -> None:
    call, batch, _ = _call()
    if match is None:  # what the forward accepts and that changes nothing (no cache, a None)
        assert call(**change(batch)).loss is not None
        return
    with pytest.raises(ModelCallError, match=match):
        call(**change(batch))


def test_labels_other_than_the_counted_ones_are_refused() -> None:
    """The runtime weighs each micro-batch by the tokens of the batch's labels; a loss over other
    tokens (labels made in the step, or none in the batch to count) would not be the batch's mean."""
    call, batch, logits = _call()
    fewer = batch["labels"].clone()
    fewer[:, 2] = -100
    with pytest.raises(ModelCallError, match=r"have \d+ target tokens .* batch's labels have \d+"):
        call(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=fewer)
    uncounted = ModelCall(call.pipeline, batch, logits, None)  # no labels found in the batch
    with pytest.raises(ModelCallError, match=r"found no 'labels' in the batch .* loss_items"):
        uncounted(**batch)
    full = {**batch, "labels": batch["input_ids"]}  # no ignored token: samples weigh as tokens do
    assert ModelCall(call.pipeline, full, logits, None)(**full).loss is not None


def test_hidden_states_are_not_on_the_last_stage() -> None:
    call, batch, _ = _call()
    with pytest.raises(ModelCallError, match=r"output_hidden_states=True.*logits only"):
        call(**batch, output_hidden_states=True)


def test_a_cache_with_packed_sequences_is_refused() -> None:
    """With config.use_cache=True Hugging Face's own forward attends across packed sequences."""
    model = build("llama")
    model.config.use_cache = True
    pipeline = CausalLMPipeline(model)
    with pytest.raises(ValueError, match=r"use_cache=True and the batch packs .*use_cache = False"):
        pipeline.pipeline_input(packed_batch(2, seed=1))
    pipeline.pipeline_input(padded_batch(2, seed=1))  # one sequence per row: the same either way


def test_probe_kinds_tell_padded_packed_and_plain() -> None:
    pipeline = CausalLMPipeline(build("llama"))
    padded = padded_batch(4, seed=3)
    padded["attention_mask"][0, -1] = 0  # at least one padded position

    def kind(batch: dict[str, torch.Tensor]) -> tuple[bool, ...]:  # flags on the device, read here
        return tuple(pipeline.probe_kind(pipeline.pipeline_input(batch)).tolist())

    assert kind(padded) == (True, False)
    assert kind(packed_batch(2, seed=1)) == (False, True)
    assert kind({"input_ids": padded["input_ids"]}) == (False, False)


def test_a_plan_with_other_inputs_is_refused() -> None:
    model = build("llama")
    plan = dict(model.config.base_model_pp_plan)
    model.config.base_model_pp_plan = {
        "embed_tokens": plan["embed_tokens"],
        "rotary_emb": (["hidden_states", "position_ids"], ["position_embeddings"]),
        "layers": plan["layers"],
        "norm": plan["norm"],
    }
    with pytest.raises(UnsupportedModelError, match=r"\['rotary_emb'\] take .* configure_pipeline"):
        causal_lm_parts(model)


def test_per_head_norms_the_plan_omits_are_summed_and_unknown_parameters_refused() -> None:
    made = transformers.Glm4MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True,
        n_group=1, topk_group=1,
    )  # fmt: skip
    derived = CausalLMPipeline(transformers.Glm4MoeForCausalLM(made), "model").tensor_parallel_plan(2)
    for norm in ("q_norm", "k_norm"):
        assert derived.plan[f"model.model.layers.*.self_attn.{norm}"] == "replicated_with_grad_allreduce"
    assert any("per-head norm" in note for note in derived.notes)
    model = build("llama")
    model.model.layers[1].self_attn.add_module("gate", torch.nn.Linear(8, 8))
    with pytest.raises(UnsupportedModelError, match=r"layers.1.self_attn.gate .* tensor_parallel_size=1"):
        CausalLMPipeline(model, "model").tensor_parallel_plan(2)
    assert CausalLMPipeline(model, "model").tensor_parallel_plan(1).plan  # no split: nothing to refuse


def test_causal_lm_module_asks_for_local_weights_under_pipe_tp(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning_pipe import CausalLMModule

    def under_pipe_tp(module: Any) -> Any:
        module._trainer = SimpleNamespace(strategy=SimpleNamespace(strategy_name="pipe_tp", pretrained=None))
        return module

    with pytest.raises(ValueError, match=r"not a local directory.*hf download org/model"):
        under_pipe_tp(CausalLMModule("org/model")).configure_model()
    model = build("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # an older checkpoint's format
    with pytest.raises(ValueError, match=r"pytorch_model\*.bin.*save_pretrained"):
        under_pipe_tp(CausalLMModule(str(tmp_path))).configure_model()
