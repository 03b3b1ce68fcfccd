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

from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from tests.distributed import run_distributed
from tests.hf_families import batches, build
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
        num_microbatches=4,
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
