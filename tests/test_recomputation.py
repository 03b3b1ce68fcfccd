"""Activation recomputation really happens, changes nothing in the numbers, and is refused where
it could not be replayed.

* Engine, one stage, no processes: every layer's forward runs m times with ``"never"``, 2m with
  ``"always"`` and 2m - 1 with ``"except_last"`` per training step, and the bytes autograd keeps
  for backward (the executor's accounting) shrink to the stage inputs.
* ``Trainer.fit`` with ``PipeTPStrategy(checkpoint=...)`` at pp=2: the same forward counts on each
  stage, and weights equal to one device's.
* Tensor-parallel ``"dropout"`` entries with recomputation are refused at setup.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe import PipeTPStrategy
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.schedule.builders import build_schedule
from tests.distributed import run_distributed
from tests.gpt_models import TinyGPT, token_data
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

TOL = 1e-5
M = 4
EXPECTED_CALLS = {"never": M, "except_last": 2 * M - 1, "always": 2 * M}


def _count_forwards(layers: list[nn.Module]) -> list[int]:
    counts = [0] * len(layers)
    for index, layer in enumerate(layers):

        def hook(module: nn.Module, args: Any, output: Any, index: int = index) -> None:
            counts[index] += 1

        layer.register_forward_hook(hook)
    return counts


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("mode", list(EXPECTED_CALLS))
def test_recomputation_runs_forward_again_and_keeps_less(mode: str, schedule: str) -> None:
    """Zero-bubble runs the forward again itself at the input-gradient action (torch's checkpoint
    would recompute once per backward call, and W makes several): the same counts."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)]
    counts = _count_forwards(layers)
    executor = PipelineExecutor({0: layers}, 1, [0], torch.device("cpu"), recompute=mode)
    executor.measure_activation_memory = True
    x, y = torch.randn(M * 4, 8), torch.randn(M * 4, 2)
    xs, ys = x.chunk(M), y.chunk(M)
    result = executor.run(
        build_schedule(schedule, 1, M), 0, inputs=list(xs), head=lambda out, i: F.mse_loss(out, ys[i])
    )
    # torch stops recomputing once backward has every tensor it needs, which spares the last
    # layer(s); the first layer always runs again for a recomputed micro-batch.
    assert counts[0] == EXPECTED_CALLS[mode]
    assert all(M <= c <= EXPECTED_CALLS[mode] for c in counts)
    # One micro-batch's input is 4 x 8 floats = 128 bytes; its saved activations are far more.
    # Zero-bubble's input-gradient pass runs the forward again, and that graph is held until the
    # weight pass (on one stage, the next action): recomputing spares nothing there, and the meter
    # says so (it counted the kept input only, 128 bytes, before).
    if mode == "always" and schedule == "1f1b":
        assert result.peak_activation_bytes == 128
    else:
        assert result.peak_activation_bytes > 20 * 128
    # The gradient is the whole batch's, whatever the mode.
    reference = nn.Sequential(*layers)
    grads = [p.grad.clone() for p in reference.parameters()]
    reference.zero_grad()
    F.mse_loss(reference(x), y).backward()
    for got, expected in zip(grads, [p.grad for p in reference.parameters()], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # On one stage zero-bubble's W follows its I at once: with the replay held in between, the
    # peak is what the same schedule holds without recomputation.
    if mode == "always" and schedule == "zb_h1":
        torch.manual_seed(0)
        plain = PipelineExecutor({0: layers}, 1, [0], torch.device("cpu"))
        plain.measure_activation_memory = True
        kept = plain.run(
            build_schedule(schedule, 1, M), 0, inputs=list(xs), head=lambda out, i: F.mse_loss(out, ys[i])
        )
        assert result.peak_activation_bytes == kept.peak_activation_bytes


def _dropout_grads(schedule: str, mode: str, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Dropout(0.5), nn.Tanh(), nn.Linear(64, 2)]
    executor = PipelineExecutor({0: layers}, 1, [0], torch.device("cpu"), recompute=mode)
    x, y = torch.randn(M * 4, 8), torch.randn(M * 4, 2)
    xs, ys = x.chunk(M), y.chunk(M)
    torch.manual_seed(seed)  # the dropout masks' draw
    executor.run(
        build_schedule(schedule, 1, M), 0, inputs=list(xs), head=lambda out, i: F.mse_loss(out, ys[i])
    )
    return [p.grad for layer in layers for p in layer.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_recomputation_replays_dropout_masks(schedule: str) -> None:
    """The forward run again draws the same dropout masks: gradients equal those without
    recomputation (and differ from another draw, so the comparison can fail)."""
    expected = _dropout_grads(schedule, "never")
    for mode in ("always", "except_last"):
        for got, want in zip(_dropout_grads(schedule, mode), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.allclose(_dropout_grads(schedule, "always", seed=1)[0], expected[0], atol=1e-3)


DATA = dataset(24, seed=1)  # 3 batches of 8


def fit_worker(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in EXPECTED_CALLS:
        model = Regressor()
        strategy = PipeTPStrategy(
            pipeline_parallel_size=2, num_microbatches=M, recompute=mode, timeout=timedelta(seconds=60)
        )
        counts = _count_forwards(list(model.layers))
        fit(model, strategy, 2, loader(DATA, 8, reference=False), root, max_epochs=1)
        own = strategy.runtime.partition.layer_range(strategy.pp_rank)  # type: ignore[union-attr]
        out[mode] = {
            "calls": [counts[i] for i in own],
            "params": {
                n: p.detach().clone()
                for n, p in model.named_parameters()
                if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank  # type: ignore[union-attr]
            },
        }
    # Tensor-parallel dropout cannot be replayed by recomputation: refused at setup.
    try:
        strategy = PipeTPStrategy(tensor_parallel_size=2, recompute="always", timeout=timedelta(seconds=60))
        fit(TinyGPT(dropout=0.1), strategy, 2, torch.utils.data.DataLoader(token_data(8)), root, max_epochs=1)
        out["refusal"] = "no error"
    except MisconfigurationException as err:
        out["refusal"] = str(err)
    return out


@pytest.mark.distributed
def test_fit_recomputes_on_every_stage_and_matches_one_device() -> None:
    with tempfile.TemporaryDirectory() as root:
        got = run_distributed(fit_worker, 2, root, timeout=300, init_group=False)
        reference = Regressor()
        fit(reference, "auto", 1, loader(DATA, 8, reference=True), root, max_epochs=1)
    expected = dict(reference.named_parameters())
    for mode, calls in EXPECTED_CALLS.items():
        for rank, result in enumerate(got):
            # 3 training steps of M micro-batches. The first layer of each stage runs again for
            # every recomputed micro-batch (torch stops recomputing once backward has what it
            # needs, which can spare a stage's last Linear, so only the first layer is counted).
            assert result[mode]["calls"][0] == 3 * calls, (mode, rank, result[mode]["calls"])
            for name, value in result[mode]["params"].items():
                torch.testing.assert_close(value, expected[name].detach(), atol=TOL, rtol=0, msg=name)
    for result in got:
        assert result["refusal"] == (
            'recompute="always" cannot replay the per-rank random stream of tensor-parallel "dropout" '
            'layers; use recompute="never" or drop the "dropout" entries.'
        )
