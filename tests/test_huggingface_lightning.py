"""A LightningModule that holds a Hugging Face causal LM and calls it the Hugging Face way
(``self.model(**batch).loss``) trains under ``Trainer(strategy="pipe_tp")`` with no wrapper, no
``configure_pipeline()`` and no plan, and ends where one device ends: fit, then validate and
predict on the same model and Trainer.

The strategy derives the pipeline and the tensor-parallel plan from the model itself. Compared
with ``strategy="auto"`` on one device: the logged training loss of every step (each micro-batch's
loss is its own tokens' mean; the runtime weights them by tokens, so the batch's loss is the mean
over all its tokens, as Hugging Face computes it), every weight after the fit, the validation loss
and the predicted logits. Llama with tied embeddings at pp=2 (the tie crosses the stages), Qwen3
(per-head norms whose tensor-parallel gradients are summed) at pp=2 x tp=2, padded training
batches and packed validation sequences; and Mistral written the Lightning way (``self(ids)``,
then the step's own cross-entropy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from tests.distributed import run_distributed
from tests.hf_families import batches, build, train_reference
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
STEPS, BATCH = 3, 8


class HuggingFaceStep(L.LightningModule):
    """What a Hugging Face user writes: the model as an attribute, its own loss."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build(family)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.model(**inputs).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LightningWay(HuggingFaceStep):
    """The Lightning habit: ``forward`` returns the model's logits, the step takes its own
    cross-entropy over the shifted labels (the same tokens Hugging Face's loss averages)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        self.log("train_loss", loss)
        return loss


def _rows(kind: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """The batches as the rows of a dataset (the DataLoader batches them again, in order)."""
    return [
        {k: v[i] for k, v in batch.items()} for batch in batches(kind, steps, BATCH) for i in range(BATCH)
    ]


TRAIN, VAL = _rows("padded", STEPS), _rows("packed", 2)


def _run(family: str, strategy: Any, devices: int, habit: str = "huggingface") -> dict[str, Any]:
    torch.set_num_threads(1)
    model = (LightningWay if habit == "lightning" else HuggingFaceStep)(family)
    # Under pipe_tp Lightning injects a shuffling DistributedSampler over the data axis (size 1);
    # one device gets the same sampler, so that both see one order.
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    train, val = DataLoader(TRAIN, batch_size=BATCH, sampler=sampler), DataLoader(VAL, batch_size=BATCH)
    trainer = fit(model, strategy, devices, train, max_epochs=1, num_sanity_val_steps=0)
    validated = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    predicted = trainer.predict(model, DataLoader(VAL, batch_size=BATCH))
    if devices > 1:
        state = gather_model_state(model, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    else:
        state = model.state_dict()
    return {
        "losses": model.losses,
        "val_loss": float(validated),
        "predicted": [p.detach().clone() for p in predicted or []],
        "state": {k: v.detach().clone() for k, v in state.items()},
    }


def worker(family: str, pp: int, tp: int, habit: str, sequence: bool = False) -> dict[str, Any]:
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        num_microbatches=2,
        timeout=timedelta(seconds=60),
        sequence_parallel=sequence,
    )
    return _run(family, strategy, pp * tp, habit)


CASES = {
    "llama-pp2": ("llama", 2, 1, "huggingface", False),
    "qwen3-pp2_tp2": ("qwen3", 2, 2, "huggingface", False),
    "mistral-pp2-lightning_way": ("mistral", 2, 1, "lightning", False),
    # The plan's sequence-parallel entries derived by the strategy from the model.
    "qwen3-pp2_tp2_sp": ("qwen3", 2, 2, "huggingface", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_huggingface_model_fits_validates_and_predicts_like_one_device(case: str) -> None:
    family, pp, tp, habit, sequence = CASES[case]
    got = run_distributed(worker, pp * tp, family, pp, tp, habit, sequence, timeout=300, init_group=False)
    expected = _run(family, "auto", 1, habit)
    assert len(expected["losses"]) == STEPS
    for rank, result in enumerate(got):
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOL), f"rank {rank}"
        assert result["val_loss"] == pytest.approx(expected["val_loss"], abs=TOL), f"rank {rank}"
        assert len(result["predicted"]) == len(expected["predicted"]), f"rank {rank}"
        for mine, theirs in zip(result["predicted"], expected["predicted"], strict=True):
            torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0, msg=f"rank {rank}: logits")
    state = got[0]["state"]
    assert state.keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=f"weight {key}")
    # The weights moved: the comparison is not of two untouched initialisations.
    start = build(family).state_dict()
    assert max((expected["state"][f"model.{k}"] - v).abs().max().item() for k, v in start.items()) > 1e-3


# ---------------------------------------------------------------- batches of any structure
# The most common Lightning module around a Hugging Face model: a TensorDataset's tuple, unpacked
# in the step, the model called with names. The strategy learns from the step which tensors are
# the ids, the mask and the labels (and weighs micro-batches by those labels' tokens).

TUPLE_FAMILIES = ["llama", "qwen3", "mistral", "gpt_neox"]
TUPLE_LR = 0.5


@dataclass
class TokenBatch:
    """A dataclass batch with its own field names (made by the DataLoader's collate_fn)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    targets: torch.Tensor


def _as_dataclass(rows: list[tuple[torch.Tensor, ...]]) -> TokenBatch:
    return TokenBatch(*(torch.stack(column) for column in zip(*rows, strict=True)))


def _as_renamed_dict(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    return {
        k: torch.stack(c) for k, c in zip(("ids", "mask", "targets"), zip(*rows, strict=True), strict=True)
    }


class TupleStep(L.LightningModule):
    """``ids, mask, labels = batch``, then
    ``self.model(input_ids=ids, attention_mask=mask, labels=labels)``."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build(family)
        self.losses: list[float] = []

    def unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, mask, labels = batch
        return ids, mask, labels

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = self.unpack(batch)
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=TUPLE_LR)


class DataclassStep(TupleStep):
    def unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return batch.tokens, batch.mask, batch.targets


class RenamedDictStep(TupleStep):
    """A dict with its own key names, and the model called positionally."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch["ids"], batch["mask"], labels=batch["targets"]).loss
        self.log("train_loss", loss)
        return loss


class BuiltMaskStep(TupleStep):
    """The step builds a mask itself that no batch tensor holds (its values are not the batch's
    mask's): the first stage cannot build it, so it is refused. (A mask built equal to the batch's,
    e.g. ``labels != -100`` here, is found by its values and trains.)"""

    def unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, _, labels = batch
        return ids, torch.ones_like(ids), labels


def _as_dict(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "attention_mask", "labels")
    return {k: torch.stack(c) for k, c in zip(keys, zip(*rows, strict=True), strict=True)}


def _as_int32_dict(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
    batch = _as_dict(rows)
    return {**batch, "input_ids": batch["input_ids"].int(), "attention_mask": batch["attention_mask"].int()}


class PoppedLabelsStep(TupleStep):
    """Code ported from Hugging Face's Trainer: the step takes the labels out of the batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        labels = batch.pop("labels")
        loss = self.model(**batch, labels=labels).loss
        self.log("train_loss", loss)
        return loss


class DerivedStep(TupleStep):
    """Tensors derived from an int32 batch: ids and mask cast, the default positions built, the
    labels cloned (all equal in value to the batch's, or to the model's own positions)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"].long()
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        mask, labels = batch["attention_mask"].long(), batch["labels"].clone()
        loss = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
        self.log("train_loss", loss)
        return loss


STRUCTURES: dict[str, tuple[type[TupleStep], Any]] = {
    "tuple": (TupleStep, None),
    "dataclass": (DataclassStep, _as_dataclass),
    "renamed_dict": (RenamedDictStep, _as_renamed_dict),
    "built_mask": (BuiltMaskStep, None),
    "popped_labels": (PoppedLabelsStep, _as_dict),
    "derived": (DerivedStep, _as_int32_dict),
}


def _tuple_rows() -> TensorDataset:
    steps = batches("padded", STEPS, BATCH)
    return TensorDataset(
        *(torch.cat([b[k] for b in steps]) for k in ("input_ids", "attention_mask", "labels"))
    )


def _fit_structure(family: str, structure: str, pp: int, tp: int) -> dict[str, Any]:
    module_type, collate = STRUCTURES[structure]
    model = module_type(family)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2, timeout=timedelta(seconds=60)
    )
    data = DataLoader(_tuple_rows(), batch_size=BATCH, collate_fn=collate)  # in order: the reference's
    try:
        trainer = fit(model, strategy, pp * tp, data, max_epochs=1, use_distributed_sampler=False)
    except Exception as err:  # the refusal: its message is what the test checks
        return {"error": f"{type(err).__name__}: {err}"}
    state = gather_model_state(model, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    if trainer.global_rank != 0:
        return {"losses": model.losses}
    return {"losses": model.losses, "state": {k: v.detach().clone() for k, v in state.items()}}


def structures_worker(pp: int, tp: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{family}/{structure}": _fit_structure(family, structure, pp, tp) for family, structure in cases}


STRUCTURE_LAYOUTS = {
    "pp2": (
        2,
        1,
        [(f, "tuple") for f in TUPLE_FAMILIES]
        + [("qwen3", "dataclass"), ("mistral", "renamed_dict"), ("llama", "built_mask")]
        + [("llama", "popped_labels"), ("gpt_neox", "derived")],
    ),
    "pp2_tp2": (2, 2, [(f, "tuple") for f in TUPLE_FAMILIES]),
}


@pytest.mark.parametrize("layout", list(STRUCTURE_LAYOUTS))
def test_tuple_dataclass_and_renamed_batches_train_like_the_models_own_forward(layout: str) -> None:
    """Four families fed a TensorDataset's padded tuples (mask zeros, labels -100 at the padding)
    and called with names, then a dataclass batch and a dict with its own key names called
    positionally, a dict whose labels the step pops, and an int32 dict whose tensors the step
    casts, clones or rebuilds (the default positions): the logged losses of three SGD steps and
    every weight after them equal those of the model's own forward on whole batches in one
    process. A step that builds a mask the batch does not hold is refused, naming the tuple and
    pipeline_input."""
    pp, tp, cases = STRUCTURE_LAYOUTS[layout]
    got = run_distributed(structures_worker, pp * tp, pp, tp, cases, timeout=600, init_group=False)
    refusals = [result.pop("llama/built_mask", None) for result in got]
    if refusals[0] is not None:
        assert all(r == refusals[0] for r in refusals), refusals  # every rank refuses alike
        message = refusals[0]["error"]
        assert "BatchRolesError" in message, message
        assert "attention_mask= a tensor that is not one of the batch's" in message, message
        # A TensorDataset's rows collate to a list: the message names it so.
        assert "the batch is a list holding batch[0] [8, 10] int64, batch[1]" in message, message
        assert "add it to the list" in message and "pipeline_input(self, batch)" in message, message
    gaps = {}
    for case in got[0]:
        family = case.split("/")[0]
        expected = train_reference(build(family), batches("padded", STEPS, BATCH), TUPLE_LR)
        for rank, result in enumerate(got):
            assert "error" not in result[case], f"{case} rank {rank}: {result[case].get('error')}"
            assert result[case]["losses"] == pytest.approx(expected["losses"], abs=TOL), f"{case} rank {rank}"
        state = got[0][case]["state"]
        assert state.keys() == {f"model.{k}" for k in expected["last"]}, case
        gaps[case] = max((state[f"model.{k}"] - v).abs().max().item() for k, v in expected["last"].items())
        # The weights moved: the comparison is not of two untouched initialisations.
        start = build(family).state_dict()
        assert max((expected["last"][k] - v).abs().max().item() for k, v in start.items()) > 1e-3
    assert all(gap <= TOL for gap in gaps.values()), gaps


# ---------------------------------------------------------------- a replica meets a new structure alone
class ExtraKeyCollate:
    """A collate_fn that adds a key to the second batch of data-parallel replica 1 only (that
    replica's ranks learn the new structure at a step where replica 0 does not)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.calls = dp_rank, 0

    def __call__(self, rows: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
        batch = _as_dict(rows)
        self.calls += 1
        if self.dp_rank == 1 and self.calls == 2:
            batch["sample_ids"] = torch.arange(len(rows))
        return batch


class NamedCallStep(TupleStep):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        loss = self.model(**inputs).loss
        self.log("train_loss", loss)
        return loss


def extra_key_worker() -> dict[str, Any]:
    torch.set_num_threads(1)
    dp_rank = int(os.environ["RANK"]) // 2
    model = NamedCallStep("llama")
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=30)
    )
    rows = _tuple_rows()
    # Replica r takes rows r, r+2, ...: its halves of the reference's batches, in order.
    sampler = DistributedSampler(rows, num_replicas=2, rank=dp_rank, shuffle=False)
    data = DataLoader(rows, batch_size=BATCH // 2, sampler=sampler, collate_fn=ExtraKeyCollate(dp_rank))
    trainer = fit(model, strategy, 4, data, max_epochs=1, use_distributed_sampler=False)
    state = gather_model_state(model, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    return {"state": {k: v.detach().clone() for k, v in state.items()}} if trainer.global_rank == 0 else {}


def test_a_replica_that_meets_a_new_batch_structure_alone_does_not_wait_for_the_others() -> None:
    """dp=2 x pp=2: replica 1's second batch carries an extra key, so its ranks learn the batch's
    roles again at step 2 while replica 0's run the step: the ranks agree within their replica,
    nothing hangs, and the weights after three steps are the model's own forward's on the whole
    batches."""
    got = run_distributed(extra_key_worker, 4, timeout=300, init_group=False)
    expected = train_reference(build("llama"), batches("padded", STEPS, BATCH), TUPLE_LR)
    state = got[0]["state"]
    assert state.keys() == {f"model.{k}" for k in expected["last"]}
    gap = max((state[f"model.{k}"] - v).abs().max().item() for k, v in expected["last"].items())
    assert gap <= TOL, gap
