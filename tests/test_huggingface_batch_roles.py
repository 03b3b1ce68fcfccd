"""In one process: where a step finds the Hugging Face model's inputs in a batch of any structure
(:mod:`lightning_pipe.huggingface.batch_roles`), by identity or by equal values (tensors the step
derives: a clone, a cast, the default positions; labels it builds are left to the model call), an
input the step builds refused with a message written for the batch's type, dataclass batches cut
into micro-batches, the tokens of ``shift_labels``, no deprecation warning of transformers' from the
pipeline's masks; and the learning run (:mod:`lightning_pipe.strategy.step_inputs`): on a copy of
the batch's containers, the random state kept, the ranks agreeing within their model replica."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import lightning as L
import pytest
import torch

from lightning_pipe import PipeTPStrategy
from lightning_pipe.batches.microbatch import batch_size, signature, split_microbatches
from lightning_pipe.huggingface import CausalLMPipeline, ModelCallError
from lightning_pipe.huggingface.batch_roles import (
    BatchRolesError,
    StepInputs,
    learn_roles,
    leaves,
    structural_copy,
    structure,
)
from lightning_pipe.huggingface.outputs import call_arguments
from lightning_pipe.mesh import ParallelLayout, ParallelMesh
from lightning_pipe.strategy.step_inputs import learn_step_inputs
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


# ---------------------------------------------------------------- the learning run leaves no trace
class PoppingStep(L.LightningModule):
    """Code ported from Hugging Face's Trainer: ``labels = batch.pop('labels')``; and a step that
    counts its calls and draws a random number before its model call."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build("llama")
        self.calls = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        self.calls += 1
        torch.rand(3)
        labels = batch.pop("labels")
        batch["attention_mask"] = batch["attention_mask"]  # reassigned: still the batch's tensor
        return self.model(**batch, labels=labels)


def test_the_learning_run_changes_neither_the_batch_nor_the_random_state() -> None:
    module = PoppingStep()
    module._trainer = SimpleNamespace(_active_loop=None)  # type: ignore[assignment]
    ids, mask, labels = _tensors()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    inputs = StepInputs()
    rng = torch.get_rng_state()
    gathered: list[Any] = []

    def gather(obj: Any) -> dict[int, Any]:
        gathered.append(obj)
        return {0: obj}

    learn_step_inputs(module, "training_step", (batch, 0), module.model, inputs, gather)
    # The real batch is whole (the real run pops its labels again), with the same tensors.
    assert list(batch) == ["input_ids", "attention_mask", "labels"]
    assert batch["labels"] is labels and batch["input_ids"] is ids
    assert torch.equal(torch.get_rng_state(), rng)  # the real run draws what it would have drawn
    assert module.calls == 1  # documented: the step ran once more on the first batch
    assert str(inputs.active) == "input_ids=batch['input_ids'], attention_mask=batch['attention_mask'], " + (
        "labels=batch['labels']"
    )
    assert gathered == [(str(inputs.active), None)]


def test_a_structural_copy_has_new_containers_and_the_same_tensors() -> None:
    ids, mask, labels = _tensors()
    batch = [{"a": (ids, Pair(mask, labels))}, Batch(ids, mask, labels)]
    copy = structural_copy(batch)
    assert type(copy) is list and copy is not batch and copy[0] is not batch[0]
    assert type(copy[0]["a"][1]) is Pair and copy[0]["a"][1] is not batch[0]["a"][1]
    assert type(copy[1]) is Batch and copy[1] is not batch[1] and copy[1].note == "kept"
    assert [t for _, t in leaves(copy)] == [t for _, t in leaves(batch)]
    assert all(a is b for (_, a), (_, b) in zip(leaves(copy), leaves(batch), strict=True))


# ---------------------------------------------------------------- tensors the step derives
def test_tensors_the_step_derives_from_the_batch_are_found_by_their_values() -> None:
    ids, mask, labels = _tensors()
    length = ids.shape[1]
    narrow = {"input_ids": ids.int(), "attention_mask": mask.int(), "labels": labels}
    built_labels = torch.where(mask.bool(), ids, -100)
    cases: list[tuple[Any, dict[str, Any], str]] = [
        # labels=ids.clone(): the ids' own values.
        ((ids, mask), dict(input_ids=ids, attention_mask=mask, labels=ids.clone()),
         "input_ids=batch[0], attention_mask=batch[1], labels=batch[0]"),
        # An int32 batch cast by the step.
        (narrow, dict(input_ids=narrow["input_ids"].long(), attention_mask=narrow["attention_mask"].long(),
                      labels=labels.clone()),
         "input_ids=batch['input_ids'], attention_mask=batch['attention_mask'], labels=batch['labels']"),
        # The default positions, built by the step, in either shape.
        ((ids, mask), dict(input_ids=ids, position_ids=torch.arange(length).expand_as(ids)),
         "input_ids=batch[0]"),
        ((ids, mask), dict(input_ids=ids, position_ids=torch.arange(length).unsqueeze(0)),
         "input_ids=batch[0]"),
        # Labels (or shift_labels) the step builds: left to the model call's checks.
        ((ids, mask), dict(input_ids=ids, attention_mask=mask, labels=built_labels),
         "input_ids=batch[0], attention_mask=batch[1]"),
        ((ids, mask), dict(input_ids=ids, shift_labels=built_labels[:, 1:]), "input_ids=batch[0]"),
    ]  # fmt: skip
    for batch, given, expected in cases:
        roles = learn_roles(batch, given, "step calls LlamaForCausalLM")
        assert roles is not None and str(roles) == expected, (expected, roles)
    # Positions that are not the model's own cannot be rebuilt by the first stage: refused.
    with pytest.raises(BatchRolesError, match="position_ids= a tensor that is not one of the batch's"):
        learn_roles(
            (ids, mask), dict(input_ids=ids, position_ids=torch.arange(length).expand_as(ids) + 1), "c"
        )
    # Values that differ anywhere are not the batch's tensor.
    other = mask.clone()
    other[0, 0] = 1 - other[0, 0]
    with pytest.raises(BatchRolesError, match="attention_mask= a tensor that is not one of the batch's"):
        learn_roles((ids, mask), dict(input_ids=ids, attention_mask=other), "c")


def test_the_ranks_agree_on_the_roles_within_their_model_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the ranks that share a batch (one replica's pipeline and tensor ranks) gather: another
    replica may meet a new batch structure at another step, and must not be waited for."""
    layout = ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=1)
    replica = object()
    strategy = PipeTPStrategy(pipeline_parallel_size=2)
    strategy._mesh = ParallelMesh(layout, 3, device_mesh=None, model_group=replica)  # type: ignore[arg-type]
    monkeypatch.setattr(PipeTPStrategy, "world_size", property(lambda self: 4))
    monkeypatch.setattr(PipeTPStrategy, "global_rank", property(lambda self: 3))
    calls: list[tuple[int, Any]] = []

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        calls.append((len(out), group))
        out[:] = [f"from {rank}" if rank != 3 else obj for rank in (2, 3)]

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert strategy._gather_objects("mine") == {2: "from 2", 3: "mine"}
    assert calls == [(2, replica)]
