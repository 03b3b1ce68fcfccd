"""In one process: where a step finds the Hugging Face model's inputs in a batch of any structure
(:mod:`lightning_pipe.huggingface.batch_roles`), a tensor the step builds refused with a message
written for the batch's type, dataclass batches cut into micro-batches, the tokens of
``shift_labels``, and no deprecation warning of transformers' from the pipeline's masks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch

from lightning_pipe.batches.microbatch import batch_size, signature, split_microbatches
from lightning_pipe.huggingface import CausalLMPipeline, ModelCallError
from lightning_pipe.huggingface.batch_roles import BatchRolesError, learn_roles, structure
from lightning_pipe.huggingface.outputs import call_arguments
from tests.hf_families import build, padded_batch


@dataclass
class Batch:
    tokens: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor
    note: str = "kept"
    derived: int = field(init=False, default=0)


class Pair(NamedTuple):
    ids: torch.Tensor
    labels: torch.Tensor


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = padded_batch(4, seed=2)
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


def test_the_roles_are_the_batch_tensors_the_call_was_given() -> None:
    ids, mask, labels = _tensors()
    model = build("llama")
    cases: list[tuple[Any, dict[str, Any], str]] = [
        ((ids, mask, labels), dict(input_ids=ids, attention_mask=mask, labels=labels),
         "input_ids=batch[0], attention_mask=batch[1], labels=batch[2]"),
        ([mask, (ids, labels)], dict(input_ids=ids, attention_mask=mask, labels=labels),
         "input_ids=batch[1][0], attention_mask=batch[0], labels=batch[1][1]"),
        (Batch(ids, mask, labels), dict(input_ids=ids, attention_mask=mask, labels=labels),
         "input_ids=batch.tokens, attention_mask=batch.mask, labels=batch.targets"),
        ({"ids": ids, "m": mask, "y": labels}, dict(input_ids=ids, position_ids=None, shift_labels=labels),
         "input_ids=batch['ids'], shift_labels=batch['y']"),
        # The same tensor as ids and labels; a positional call.
        (Pair(ids, labels), call_arguments(model, (ids,), {"labels": ids}),
         "input_ids=batch[0], labels=batch[0]"),
        # No labels in the call, but a dict batch's 'labels' still counts the tokens.
        ({"input_ids": ids, "labels": labels}, dict(input_ids=ids),
         "input_ids=batch['input_ids'], labels=batch['labels']"),
    ]  # fmt: skip
    for batch, given, expected in cases:
        roles = learn_roles(batch, given, "step calls LlamaForCausalLM")
        assert roles is not None and str(roles) == expected
        # What the pipeline reads from any micro-batch of the batch: a collator's dict.
        piece = split_microbatches(batch, 2)[1]
        selected = roles.select(piece)
        assert selected["input_ids"].shape == (2, ids.shape[1])
        assert torch.equal(selected["input_ids"], ids[2:])
    assert learn_roles((ids,), {"inputs_embeds": ids}, "call") is None  # the call refuses that itself


@pytest.mark.parametrize(
    ("batch", "kind", "fix"),
    [
        (lambda ids, labels: (ids, labels), "a tuple holding batch[0] [4, 10] int64, batch[1]",
         "to the tuple"),
        (lambda ids, labels: {"ids": ids, "y": labels}, "a dict holding batch['ids'] [4, 10] int64",
         "add a key 'attention_mask' to the dict"),
        (lambda ids, labels: Batch(ids, ids, labels), "a Batch dataclass holding batch.tokens",
         "add a field for it to Batch"),
    ],
)  # fmt: skip
def test_a_tensor_the_step_builds_is_refused_for_the_batch_it_has(batch: Any, kind: str, fix: str) -> None:
    ids, _, labels = _tensors()
    built = (labels != -100).long()
    with pytest.raises(BatchRolesError, match="pipeline_input") as caught:
        learn_roles(batch(ids, labels), dict(input_ids=ids, attention_mask=built), "s calls M")
    message = str(caught.value)
    assert isinstance(caught.value, ModelCallError)
    assert f"the batch is {kind}" in message and fix in message, message
    # A slice of a batch tensor is not one of its tensors either.
    with pytest.raises(BatchRolesError, match="input_ids= a tensor that is not one of the batch's"):
        learn_roles(batch(ids, labels), dict(input_ids=ids[:, :-1]), "s calls M")


def test_a_batch_without_a_learned_place_says_so() -> None:
    ids, mask, _ = _tensors()
    roles = learn_roles({"ids": ids, "mask": mask}, dict(input_ids=ids, attention_mask=mask), "c")
    assert roles is not None
    with pytest.raises(BatchRolesError, match=r"no batch\['mask'\]"):
        roles.select({"ids": ids})
    assert structure({"ids": ids}) != structure({"ids": ids, "mask": mask})
    assert structure((ids, mask)) == structure((ids[:2], mask[:2]))  # sizes do not matter


def test_dataclass_batches_are_cut_into_micro_batches() -> None:
    ids, mask, labels = _tensors()
    batch = Batch(ids, mask, labels)
    assert batch_size(batch) == 4
    pieces = split_microbatches(batch, 2)
    assert [type(p) for p in pieces] == [Batch, Batch]
    assert torch.equal(pieces[1].mask, mask[2:]) and torch.equal(pieces[0].targets, labels[:2])
    assert pieces[1].note == "kept"
    assert signature(pieces[0]) == signature(pieces[1]) != signature(Batch(ids, mask, labels[:, :4]))


def test_shift_labels_count_their_tokens_unshifted() -> None:
    pipeline = CausalLMPipeline(build("llama"))
    shift = torch.tensor([[5, -100, 7], [-100, -100, 8]])
    items = pipeline.loss_items({"input_ids": shift.clamp(min=0), "shift_labels": shift})
    assert items is not None and items.tolist() == [2, 1]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_pipeline_masks_raise_no_deprecation_warning(family: str) -> None:
    """transformers renamed create_masks_for_generate's past_key_values to cache; the layers'
    masks (rebuilt on every stage, every micro-batch) and the setup check must not warn."""
    pipeline = CausalLMPipeline(build(family))
    probe = pipeline.pipeline_input(padded_batch(3, seed=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pipeline.check(probe, own_layers=pipeline.layers()) == (None, None)
        x: Any = probe
        for layer, call in zip(pipeline.layers(), pipeline.calls(), strict=True):
            x = call(layer, x)
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []
