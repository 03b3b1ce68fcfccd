"""Hugging Face habits a Lightning module brings along, told and honoured by pipe_tp (issue 41).

* ``model.gradient_checkpointing_enable()`` (default arguments, ``use_reentrant=False``,
  ``use_reentrant=True``): pipe_tp turns the model's own checkpoint off inside its stages and
  recomputes the stages itself (``recompute="always"``), which the layout log says; training
  equals the model's own checkpointed training on one device (losses and weights, 1e-5), and the
  model's checkpoint function never runs under pipe_tp (no double recomputation, no reentrant
  checkpoint inside the executor's backward), while each held layer does run twice per training
  micro-batch (its recomputation). Turned on after setup (in ``on_train_start``), it is taken
  over at the first training batch the same way, with a warning (the layout log is out by then).
* Dropout on in the config (``attention_dropout=0.1``, drawn by functional dropout inside the
  attention modules): the layout log says once which modules draw, that the masks differ from
  one device's by design, and ``layer_seeded_dropout=True``; with that option on, it says the
  masks are layer-seeded; a model without dropout gets no such line.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint.full import gather_model_state
from tests.distributed import run_distributed
from tests.hf_families import batches, build, config
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
STEPS, BATCH, MICRO = 3, 8, 4
FAMILY = "llama"  # tied embeddings across the two stages
VARIANTS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "non_reentrant": {"use_reentrant": False},
    "reentrant": {"use_reentrant": True},
}
SCHEDULES = {"default": "1f1b", "non_reentrant": "gpipe", "reentrant": "zb_h1", "late": "1f1b"}
"""The schedule each variant runs under; ``"late"``: default arguments, turned on in
``on_train_start``, after the strategy's setup."""


class Checkpointed(L.LightningModule):
    """A Hugging Face model with its own gradient checkpointing on, trained by its own loss; counts
    the calls of the model's checkpoint function and the training forwards of each decoder layer."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.model = build(FAMILY)
        self.variant = variant
        self.checkpoint_calls = 0
        self.forwards: dict[int, int] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._count(i))
        self.losses: list[float] = []
        if variant != "late":
            self._enable()

    def on_train_start(self) -> None:
        if self.variant == "late":  # after the strategy's setup, before the first batch
            self._enable()

    def _enable(self) -> None:
        kwargs = VARIANTS.get(self.variant)
        if kwargs is None:
            self.model.gradient_checkpointing_enable()
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for layer in self.model.model.layers:
            own = layer._gradient_checkpointing_func

            def counted(*args: Any, own: Any = own, **kwargs: Any) -> Any:
                self.checkpoint_calls += 1
                return own(*args, **kwargs)

            layer._gradient_checkpointing_func = counted

    def _count(self, i: int) -> None:
        if torch.is_grad_enabled() and self.training:
            self.forwards[i] = self.forwards.get(i, 0) + 1

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


ROWS = [{k: v[i] for k, v in b.items()} for b in batches("padded", STEPS, BATCH) for i in range(BATCH)]


def _fit(variant: str, strategy: Any, devices: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = Checkpointed(variant)
    sampler = DistributedSampler(ROWS, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer = fit(model, strategy, devices, DataLoader(ROWS, batch_size=BATCH, sampler=sampler), max_epochs=1)
    if devices > 1:
        state = gather_model_state(model, trainer.strategy.runtime.partition, trainer.strategy.mesh)
    else:
        state = model.state_dict()
    return {
        "losses": model.losses,
        "state": {k: v.detach().clone() for k, v in state.items()},
        "checkpoint_calls": model.checkpoint_calls,
        "forwards": dict(model.forwards),
        "flags": [layer.gradient_checkpointing for layer in model.model.model.layers],
    }


class WithDropout(L.LightningModule):
    """The family's model with ``attention_dropout=0.1`` in its config."""

    def __init__(self) -> None:
        super().__init__()
        made = config(FAMILY)
        made.attention_dropout = 0.1
        self.model = transformers.LlamaForCausalLM(made)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def checkpointing_worker() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for seeded in (False, True):
        strategy = PipeTPStrategy(
            pipeline_parallel_size=2,
            num_microbatches=2,
            layer_seeded_dropout=seeded,
            timeout=timedelta(seconds=60),
        )
        fit(WithDropout(), strategy, 2, DataLoader(ROWS, batch_size=BATCH), max_steps=1)
        results[f"dropout_seeded={seeded}"] = strategy.runtime.describe()
    for variant, schedule in SCHEDULES.items():
        strategy = PipeTPStrategy(
            pipeline_parallel_size=2, num_microbatches=MICRO, schedule=schedule, timeout=timedelta(seconds=60)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _fit(variant, strategy, 2)
        result["warnings"] = [str(w.message) for w in caught if "gradient checkpointing" in str(w.message)]
        result["log"] = strategy.runtime.describe()
        result["recompute"] = strategy.runtime.executor.recompute.value
        results[variant] = result
    return results


def test_gradient_checkpointing_becomes_recomputation_and_dropout_is_said() -> None:
    got = run_distributed(checkpointing_worker, 2, timeout=400, init_group=False)
    for rank, results in enumerate(got):
        for seeded in (False, True):
            log = results[f"dropout_seeded={seeded}"]
            lines = [line for line in log.splitlines() if "dropout" in line]
            assert len(lines) == 1, (rank, log)
            (line,) = lines
            assert (
                "dropout in training, drawn by 4 modules: "
                "model.model.layers.0.self_attn (attention_dropout=0.1)" in line
            )
            if seeded:
                assert (
                    "layer-seeded (layer_seeded_dropout): the same masks on every pipeline and tensor layout"
                    in line
                )
            else:
                assert (
                    "masks differ from one device's by design" in line and "layer_seeded_dropout=True" in line
                )
        for variant in SCHEDULES:  # no dropout in the family's config: nothing said
            assert "dropout" not in results[variant]["log"], results[variant]["log"]
    for variant in SCHEDULES:
        expected = _fit(variant, "auto", 1)
        # The reference is the model's own checkpointed training: its function ran, per layer.
        assert expected["checkpoint_calls"] >= STEPS * 4, expected["checkpoint_calls"]
        assert len(expected["losses"]) == STEPS
        for rank, results in enumerate(got):
            result = results[variant]
            where = f"{variant}, rank {rank}"
            assert result["losses"] == pytest.approx(expected["losses"], abs=TOL), where
            assert result["checkpoint_calls"] == 0, where  # the model's own checkpoint never ran
            assert result["flags"] == [False] * 4, where
            assert result["recompute"] == "always", where
            words = "recompute always (as the model asked: its own gradient checkpointing"
            first = result["log"].splitlines()[0]
            if variant == "late" and rank == 0:  # the layout log was out before: a warning says it
                (warned,) = result["warnings"]
                assert warned.startswith(
                    "pipe_tp: the model's gradient checkpointing was turned on after setup"
                )
                assert words in warned, warned
            else:  # rank 0 warns for the job
                assert result["warnings"] == [], where
            assert words in first, first
            assert "model.model.layers.0, model.model.layers.1, model.model.layers.2 and 1 more" in first
            # Each held decoder layer: a forward and its recomputation per training micro-batch.
            assert result["forwards"] and all(n == 2 * STEPS * MICRO for n in result["forwards"].values()), (
                where,
                result["forwards"],
            )
        state = got[0][variant]["state"]
        assert state.keys() == expected["state"].keys()
        for key, value in expected["state"].items():
            torch.testing.assert_close(state[key], value, atol=TOL, rtol=0, msg=f"{variant}: {key}")
