"""``partition="time"``: layers timed one at a time on a sample micro-batch,
split so that the slowest stage is as fast as it can be.

* No processes: :func:`profile_layers` measures what each layer costs (a sleeping layer is slow,
  forward and backward apart), leaves the model alone (no gradient, BatchNorm statistics,
  random state or meta tensor changes), and :func:`compute_balance` splits by those times.
* ``Trainer.fit`` at pp=2 with ``partition="time"`` on a model whose one slow layer has no
  parameters: the split differs from ``"parameters"``'s (that is the point), every rank computes
  the same one, the layout log shows the measured time per stage, and the weights after training
  equal one device's; without ``example_input_array`` the error says what to set.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipeTPStrategy
from lightning_pipe.partition.balance import compute_balance
from lightning_pipe.partition.profile import profile_layers
from tests.distributed import run_distributed
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

SLOW_S = 0.01
PROFILED_SLOW_S = 0.2
"""The slow layers of the profiling test: far above what a tiny layer takes even on a loaded CI
machine (a Linear(8, 8) was once measured at 53 ms there), so the comparison is not a race."""


class Slow(nn.Module):
    """No parameters, ``seconds`` forward (and, through the sleep's identity, ~0 backward)."""

    def __init__(self, seconds: float = SLOW_S) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SlowBackward(nn.Module):
    def __init__(self, seconds: float = SLOW_S) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x, self.seconds)


def test_profile_measures_each_layer_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    slow = PROFILED_SLOW_S
    layers = [
        nn.Linear(8, 8), Slow(slow), nn.BatchNorm1d(8), SlowBackward(slow), nn.Dropout(0.5), nn.Linear(8, 2)
    ]  # fmt: skip
    with torch.device("meta"):
        meta_layer = nn.Linear(8, 8)
    layers.append(nn.Sequential(nn.Linear(2, 8), meta_layer))  # a layer built on the meta device
    sample = torch.randn(4, 8)
    state = torch.get_rng_state()
    stats = layers[2].running_mean.clone()  # type: ignore[union-attr]
    times = profile_layers(layers, sample, torch.device("cpu"))
    assert len(times) == len(layers)
    assert times[1].forward >= slow and times[1].backward < slow / 2
    assert times[3].backward >= slow and times[3].forward < slow / 2
    fast = [t.total for k, t in enumerate(times) if k not in (1, 3)]
    assert max(fast) < slow / 2
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert torch.equal(torch.get_rng_state(), state), "profiling must not draw from the run's random stream"
    assert torch.equal(layers[2].running_mean, stats)  # type: ignore[union-attr,arg-type]
    assert meta_layer.weight.is_meta
    # Split by the times: the two slow layers go to different stages (where the fast ones go is
    # a tie that the measured noise decides).
    totals = [t.total for t in times]
    assert compute_balance(layers, 2, "time", totals) in ([2, 5], [3, 4])
    three = compute_balance(layers, 3, "time", totals)
    stage_of = [s for s, n in enumerate(three) for _ in range(n)]
    assert stage_of[1] != stage_of[3], three  # the two slow layers never share a stage


def test_time_partition_needs_one_time_per_layer() -> None:
    with pytest.raises(
        ValueError, match=r'partition="time" needs one measured time per layer \(2\), got none'
    ):
        compute_balance([nn.Linear(1, 1), nn.Linear(1, 1)], 2, "time")


class SlowRegressor(Regressor):
    """Regressor with a parameter-free slow layer second: balanced by time, stage 0 is the first
    Linear and the slow layer; balanced by parameters, it is not."""

    def __init__(self, example: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(6, 32),
            Slow(),
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 3),
        )
        if example:
            self.example_input_array = torch.zeros(8, 6)


def _fit(strategy: Any, devices: int, model: L.LightningModule) -> None:
    """One epoch on the same data for the pipeline and for the one-device reference."""
    fit(model, strategy, devices, loader(dataset(16, seed=1), 8, reference=devices == 1), max_epochs=1)


def fit_worker() -> dict[str, Any]:
    model = SlowRegressor()
    strategy = PipeTPStrategy(pipeline_parallel_size=2, partition="time", timeout=timedelta(seconds=60))
    _fit(strategy, 2, model)
    runtime = strategy.runtime
    out: dict[str, Any] = {
        "balance": runtime.partition.balance,
        "log": runtime.describe(None),
        "params": {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if runtime.partition.stage_of_key(n) in runtime.stage_indices
        },
    }
    try:
        _fit(PipeTPStrategy(pipeline_parallel_size=2, partition="time"), 2, SlowRegressor(example=False))
        out["error"] = "no error"
    except Exception as err:  # the message is what the test checks
        out["error"] = str(err)
    return out


@pytest.mark.distributed
def test_fit_partitioned_by_time_matches_one_device() -> None:
    got = run_distributed(fit_worker, 2, timeout=240, init_group=False)
    assert [r["balance"] for r in got] == [(2, 4), (2, 4)]
    assert "ms forward + backward per micro-batch (measured)" in got[0]["log"]
    reference = SlowRegressor()
    _fit("auto", 1, reference)
    merged = {n: p for r in got for n, p in r["params"].items()}
    assert merged.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(merged[name], param.detach(), atol=1e-5, rtol=0, msg=name)
    for r in got:
        assert 'partition="time" times each layer on a sample micro-batch, and none was given' in r["error"]
        assert "set `self.example_input_array`" in r["error"], r["error"]


def test_profile_error_names_the_layer_and_the_sample() -> None:
    layers = [nn.Linear(8, 8), nn.Linear(8, 2)]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        profile_layers(layers, torch.randn(4, 7), torch.device("cpu"))
    assert any(
        'partition="time" was timing pipeline layer 0 (Linear)' in note for note in info.value.__notes__
    )
