"""``PipeTPStrategy(layout="auto")``: the options the user set are kept, the memory limit decides
which layouts may run, the choice trains like one device and is recorded in the checkpoint, and
a limit nothing meets is refused on every rank before the model is materialised.

Two launches of two gloo processes: one where only some layouts fit ``max_memory`` (a pipe_tp
fit under ``layout="auto"``, its checkpoint resumed under ``layout="auto"`` with the data size
pinned, compared with one device), one where nothing fits (and, first, a module without a sample
batch). The rest is single-process.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.planning import Constraints, DataMode, LayerCost, Links, Machine, ModelCosts, ModelShape
from lightning_pipe.planning.auto import parse_memory, plan_replica_batch
from lightning_pipe.planning.planner import plan_layout
from lightning_pipe.schedule.builders import ScheduleKind
from lightning_pipe.strategy.auto_layout import AUTO_LAYOUT_KEY, batch_differs
from tests.distributed import run_distributed
from tests.gpt_models import LateGPT, token_data
from tests.trainers import fit, quiet_trainer

TOL = 1e-5
SEED = 1234
DATA = token_data(48)
BATCH = 8
"""Samples per data-parallel replica (the dataloader's batch and the sample's)."""
LIMIT = "100kB"
"""Under which pp=1 with every rank holding the whole model (the tiny GPT's AdamW-counted state
and a batch's activations) does not fit, and a two-stage pipeline does."""
TOO_SMALL = "20kB"
TIMEOUT = timedelta(seconds=90)


class AutoGPT(LateGPT):
    """LateGPT with a sample batch for the planner to measure on (one replica's batch)."""

    def __init__(self, build_now: bool = False, sample: bool = True) -> None:
        super().__init__(build_now=build_now)
        if sample:
            self.example_input_array = DATA.tensors[0][:BATCH]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.values.append(float(outputs["loss"]))


def _auto(**kwargs: Any) -> PipeTPStrategy:
    return PipeTPStrategy(layout="auto", timeout=TIMEOUT, **kwargs)


def fits_worker(root: str) -> dict[str, Any]:
    """An eager model (its initial weights are the parent's, from the same seed) fitted for an epoch
    under layout="auto", saved, then resumed for another under layout="auto" with the data size
    pinned to the first choice's."""
    torch.manual_seed(SEED)
    model = AutoGPT(build_now=True)
    strategy, losses = _auto(max_memory=LIMIT), Losses()
    trainer = fit(
        model, strategy, 2, DataLoader(DATA, batch_size=BATCH), root, max_epochs=1, callbacks=[losses]
    )
    assert strategy.auto_plan is not None
    chosen = strategy.auto_plan
    # A later call of the same Trainer keeps the choice (the model is split for it).
    validated = trainer.validate(model, DataLoader(DATA, batch_size=BATCH), verbose=False)
    assert strategy.auto_plan is chosen and validated and "val_loss" in validated[0]
    ckpt = os.path.join(root, "auto.ckpt")
    trainer.save_checkpoint(ckpt)
    dp = strategy.auto_plan.chosen().candidate.data_parallel_size
    resumed, more = _auto(max_memory=LIMIT, data_parallel_size=dp), Losses()
    torch.manual_seed(SEED + 1)  # another start: the checkpoint must bring the weights back
    fit(
        AutoGPT(build_now=True), resumed, 2, DataLoader(DATA, batch_size=BATCH), root, ckpt,
        max_epochs=2, callbacks=[more],
    )  # fmt: skip
    return {
        "plan": strategy.auto_plan,
        "resumed_plan": resumed.auto_plan,
        "losses": losses.values + more.values,
        "ckpt": ckpt,
        "mesh": (strategy.mesh.layout.pipeline_parallel_size, strategy.mesh.layout.data_parallel_size),
        "options": strategy.options,
    }


def _one_device(dp: int, epochs: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model on one device, on the batch all ``dp`` replicas step on together."""
    torch.manual_seed(SEED)
    model = AutoGPT(build_now=True)
    losses = Losses()
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, seed=0)  # what Lightning injects
    fit(
        model,
        "auto",
        1,
        DataLoader(DATA, batch_size=BATCH * dp, sampler=sampler),
        max_epochs=epochs,
        callbacks=[losses],
    )
    return losses.values, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.distributed
def test_auto_picks_a_layout_that_fits_the_memory_and_trains_like_one_device() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(fits_worker, 2, root, timeout=240, init_group=False)
        plan, resumed_plan = got[0]["plan"], got[0]["resumed_plan"]
        limit = parse_memory(LIMIT)
        best = plan.chosen()
        # The decision, from the plan every rank agreed on: it fits, and the layout that keeps the
        # whole model on each rank (pp=1, replicated) does not.
        assert all(r["plan"] == plan for r in got)
        assert best.peak_bytes <= limit
        whole = [
            p for p in plan.predictions
            if p.candidate.pipeline_parallel_size == 1 and p.candidate.tensor_parallel_size == 1
            and p.candidate.data_mode is DataMode.REPLICATED
        ]  # fmt: skip
        assert whole and all(p.peak_bytes > limit for p in whole)
        c = best.candidate
        assert got[0]["mesh"] == (c.pipeline_parallel_size, c.data_parallel_size)
        assert got[0]["options"].num_microbatches == c.num_microbatches
        assert got[0]["options"].recompute_mode is c.recompute
        # Resumed under auto with the data size pinned: the pin is kept.
        assert resumed_plan.chosen().candidate.data_parallel_size == c.data_parallel_size
        # The checkpoint records the choice and holds the weights one device reaches.
        saved = consolidate_checkpoint(got[0]["ckpt"])
        assert saved[AUTO_LAYOUT_KEY]["layout"] == str(c)
        assert saved[AUTO_LAYOUT_KEY]["predicted_peak_bytes"] == best.peak_bytes
        losses, weights = _one_device(c.data_parallel_size, 1)
        for key, value in weights.items():
            torch.testing.assert_close(saved["state_dict"][key], value, atol=TOL, rtol=0, msg=key)
        all_losses, _ = _one_device(c.data_parallel_size, 2)
    # Each rank's loss is its replica's: their mean is the batch's.
    mean = [sum(r["losses"][i] for r in got) / len(got) for i in range(len(got[0]["losses"]))]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(all_losses), atol=TOL, rtol=0)
    assert len(losses) * 2 == len(all_losses)


def refusing_worker() -> dict[str, Any]:
    """Two fits that must stop at setup, before the model (built in configure_model) is
    materialised: one without a sample batch, one with a limit nothing meets."""
    out: dict[str, Any] = {}
    for name, model, limit in (
        ("no_sample", AutoGPT(sample=False), LIMIT),
        ("too_small", AutoGPT(), TOO_SMALL),
    ):
        trainer = quiet_trainer(_auto(max_memory=limit), 2, max_epochs=1)
        try:
            trainer.fit(model, DataLoader(DATA, batch_size=BATCH))
        except MisconfigurationException as err:
            out[name] = str(err)
        assert model.layers is not None
        out[f"{name}_meta"] = all(p.is_meta for p in model.parameters())
    return out


@pytest.mark.distributed
def test_auto_refuses_on_every_rank_before_materialising() -> None:
    got = run_distributed(refusing_worker, 2, timeout=180, init_group=False)
    for rank in got:
        assert rank["no_sample_meta"] and rank["too_small_meta"], rank
        assert "example_input_array" in rank["no_sample"], rank
        refusal = rank["too_small"]
        assert "No layout fits: the model needs " in refusal and " per rank at best (pp=" in refusal, refusal
        assert f"the limit is {parse_memory(TOO_SMALL) / 1e3:.3g} kB" in refusal, refusal
    assert got[0]["too_small"] == got[1]["too_small"]


# ------------------------------------------------------------------------------ single process
def test_options_left_at_their_defaults_are_the_planners_and_the_others_are_kept() -> None:
    assert _auto(max_memory="1GB").auto_constraints == Constraints()
    kept = _auto(
        max_memory=2**30, tensor_parallel_size=2, schedule="gpipe", recompute="always", num_microbatches=4,
        shard_parameters=True, data_parallel_size=2,
    ).auto_constraints  # fmt: skip
    assert kept == Constraints(
        tensor_parallel_size=2, data_parallel_size=2, data_mode=DataMode.FSDP2, schedule=ScheduleKind.GPIPE,
        num_microbatches=4, recompute=RecomputeMode.ALWAYS,
    )  # fmt: skip
    assert PipeTPStrategy().auto_constraints is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_memory": "4GB"}, "pass layout='auto' too"),
        ({"layout": "fast"}, "layout must be 'auto' or None"),
        ({"layout": "auto", "max_memory": "4 parsecs"}, "max_memory must be a number of bytes"),
        ({"layout": "auto", "max_memory": 0}, "positive amount"),
        ({"layout": "auto", "context_parallel_size": 2}, "does not plan context_parallel_size"),
        ({"layout": "auto", "partition": [1, 3]}, "layer counts per stage"),
    ],
)
def test_auto_options_are_refused_with_one_sentence(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipeTPStrategy(**kwargs)


def test_auto_on_cpu_needs_max_memory_before_launch() -> None:
    with pytest.raises(MisconfigurationException, match="needs max_memory on cpu"):
        quiet_trainer(PipeTPStrategy(layout="auto"), 2)


def test_max_memory_units() -> None:
    assert parse_memory("4GB") == 4e9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(1000) == 1000.0
    assert parse_memory("1.5 kb") == 1500.0


def test_layouts_are_compared_per_sample_of_one_replica() -> None:
    """A layout with dp replicas steps on dp replicas' batches: its time is counted per replica's
    batch, so two replicas that each take as long as one pipeline of the whole batch are twice as
    fast (hand-written costs: the right answer is known)."""
    layer = LayerCost(forward_seconds=1.0, backward_seconds=2.0, parameter_bytes=100, output_bytes=10)
    costs = ModelCosts((layer, layer), rows=4, optimizer_state_factor=0.0)
    machine = Machine(2, 1e9, Links(overlap_data_parallel=False))
    shape = ModelShape(2)
    plan = plan_replica_batch(costs, machine, shape, 4, Constraints())
    for dp in (1, 2):
        direct = plan_layout(costs, machine, shape, 4 * dp, Constraints(data_parallel_size=dp))
        for p in direct.predictions:
            same = [q for q in plan.predictions if q.candidate == p.candidate]
            assert len(same) == 1 and same[0].step_seconds == pytest.approx(p.step_seconds / dp)
            assert same[0].peak_bytes == p.peak_bytes
    assert plan.best is not None and plan.best.candidate.data_parallel_size == 2


def test_every_part_of_a_per_sample_time_is_divided_like_the_step() -> None:
    """The table's parts add up to the step: with the optimizer step timed and processes sharing
    cores, the optimizer and shared-cores parts of a dp=2 layout are halved like its step."""
    layer = LayerCost(
        forward_seconds=1.0, backward_seconds=2.0, parameter_bytes=100, output_bytes=10, optimizer_seconds=0.5
    )
    costs = ModelCosts((layer, layer), rows=4, optimizer_state_factor=0.0)
    machine = Machine(2, 1e9, Links(overlap_data_parallel=False), compute_slots=1.0)
    shape = ModelShape(2)
    plan = plan_replica_batch(costs, machine, shape, 4, Constraints())
    direct = plan_layout(costs, machine, shape, 8, Constraints(data_parallel_size=2))
    for p in direct.predictions:
        (same,) = [q for q in plan.predictions if q.candidate == p.candidate]
        assert p.optimizer_seconds > 0 and p.shared_compute_seconds > 0, p
        assert same.optimizer_seconds == pytest.approx(p.optimizer_seconds / 2)
        assert same.shared_compute_seconds == pytest.approx(p.shared_compute_seconds / 2)
        parts = (
            same.compute_seconds + same.bubble_seconds + same.tensor_seconds + same.recompute_seconds
        ) + (same.data_seconds + same.optimizer_seconds + same.shared_compute_seconds)
        assert same.step_seconds == pytest.approx(parts), same


def test_a_batch_of_another_size_than_planned_is_warned_about() -> None:
    layer = LayerCost(forward_seconds=1.0, backward_seconds=2.0, parameter_bytes=100, output_bytes=10)
    costs = ModelCosts((layer, layer), rows=4)
    plan = plan_replica_batch(costs, Machine(2, 1e9), ModelShape(2), 8, Constraints())
    assert batch_differs(plan, (torch.zeros(8, 3), torch.zeros(8))) is None
    warning = batch_differs(plan, (torch.zeros(6, 3), torch.zeros(6)))
    assert warning is not None and "planned for 8 samples per replica" in warning and "have 6" in warning


def test_the_choice_is_recorded_in_the_loggers_hyperparameters(tmp_path: Any) -> None:
    """``log_choice`` (called at setup under ``layout="auto"``) gives every logger the chosen layout,
    its options and the prediction as flat hyperparameters; a CSV logger writes them to its
    ``hparams.yaml``."""
    from lightning.pytorch.loggers import CSVLogger, Logger

    from lightning_pipe.planning.auto import record
    from lightning_pipe.strategy.auto_layout import log_choice

    seen: list[dict[str, Any]] = []

    class Capture(Logger):
        name = "capture"
        version = 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            seen.append(dict(params))

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            pass

    layer = LayerCost(forward_seconds=1.0, backward_seconds=2.0, parameter_bytes=100, output_bytes=10)
    plan = plan_replica_batch(
        ModelCosts((layer, layer), rows=4), Machine(2, 1e9), ModelShape(2), 8, Constraints()
    )
    csv = CSVLogger(str(tmp_path))
    values = log_choice([Capture(), csv], plan)
    assert seen == [values]
    chosen = plan.chosen()
    assert values[f"{AUTO_LAYOUT_KEY}/layout"] == str(chosen.candidate)
    assert values[f"{AUTO_LAYOUT_KEY}/pipeline_parallel_size"] == chosen.candidate.pipeline_parallel_size
    assert values[f"{AUTO_LAYOUT_KEY}/predicted_seconds_per_replica_batch"] == chosen.step_seconds
    assert len(values) == len(record(plan))
    csv.save()
    written = (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()
    assert f"{AUTO_LAYOUT_KEY}/layout: {chosen.candidate}" in written
