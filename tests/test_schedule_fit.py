"""``Trainer.fit`` with ``schedule="interleaved_1f1b"`` (two stages per rank, loop placement) and
``schedule="zb_h1"`` (zero-bubble: backward split into input and weight gradients) ends where one
device ends: weights after two epochs within 1e-5, at pp=2 and pp=4,
with 1, 3 and 8 micro-batches, accumulation, global-norm clipping, activation recomputation,
data parallelism and a token embedding tied to the output head across ranks.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from tests.distributed import run_distributed
from tests.lightning_models import HIDDEN, IN, OUT, TOKENS, Regressor, TiedLM, dataset, loader
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
TRAIN = dataset(40, seed=1)


class DeepRegressor(Regressor):
    """Regressor with 10 pipeline layers, enough for 4 ranks x 2 stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        sizes = [IN, HIDDEN, HIDDEN, HIDDEN, HIDDEN, OUT]
        layers: list[nn.Module] = []
        for k in range(5):
            layers += [nn.Linear(sizes[k], sizes[k + 1])] + ([nn.Tanh()] if k < 4 else [])
        self.layers = nn.Sequential(*layers)


def _settings(acc: int, clip: float | None) -> dict[str, Any]:
    """Two epochs with the case's accumulation and clipping, under pipe_tp and on one device."""
    return {"max_epochs": 2, "accumulate_grad_batches": acc, "gradient_clip_val": clip}


CASES = [
    pytest.param(schedule, *case, id=f"{schedule}-{name}")
    for schedule in ("interleaved_1f1b", "zb_h1")
    for name, case in (
        ("pp2-m3-acc2-clip", (2, 3, "never", 2, 0.05)),
        ("pp2-m1-recompute", (2, 1, "always", 1, None)),
        ("pp4-m8-recompute-clip", (4, 8, "except_last", 1, 0.05)),
    )
]


def _virtual(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def worker(schedule: str, pp: int, m: int, recompute: str, acc: int, clip: float | None) -> dict[str, Any]:
    model = DeepRegressor()
    v = _virtual(schedule)
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, schedule=schedule, virtual_stages=v, num_microbatches=m,
        recompute=recompute, timeout=timedelta(seconds=90),
    )  # fmt: skip
    fit(model, strategy, pp, loader(TRAIN, 8, reference=False), **_settings(acc, clip))
    runtime = strategy.runtime
    assert runtime.stage_indices == tuple(strategy.pp_rank + c * pp for c in range(v))
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if runtime.partition.stage_of_key(n) in runtime.stage_indices
    }


@pytest.mark.parametrize(("schedule", "pp", "m", "recompute", "acc", "clip"), CASES)
def test_fit_matches_one_device(
    schedule: str, pp: int, m: int, recompute: str, acc: int, clip: float | None
) -> None:
    got = run_distributed(worker, pp, schedule, pp, m, recompute, acc, clip, timeout=300, init_group=False)
    merged = {n: p for r in got for n, p in r.items()}
    model = DeepRegressor()
    fit(model, "auto", 1, loader(TRAIN, 8, reference=True), **_settings(acc, clip))
    assert merged.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(merged[name], param.detach(), atol=TOL, rtol=0, msg=name)


def tied_worker(schedule: str) -> dict[str, Any]:
    model = TiedLM()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2,
        schedule=schedule,
        num_microbatches=2,
        timeout=timedelta(seconds=90),
    )
    world = int(os.environ["WORLD_SIZE"])
    fit(model, strategy, world, DataLoader(TOKENS, batch_size=4), **_settings(2, None))
    runtime = strategy.runtime
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters(remove_duplicate=False)
        if runtime.partition.stage_of_key(n) in runtime.stage_indices
    }


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1"])
def test_dp2_with_weights_tied_across_ranks_matches_one_device(schedule: str) -> None:
    """dp=2 x pp=2; interleaved: 2 stages per rank, embedding on stage 0 (rank 0), head on
    stage 3 (rank 1); zero-bubble: the head's weight gradient in the last W of rank 1."""
    got = run_distributed(tied_worker, 4, schedule, timeout=300, init_group=False)
    model = TiedLM()
    sampler = DistributedSampler(TOKENS, num_replicas=1, rank=0, seed=0)
    fit(model, "auto", 1, DataLoader(TOKENS, batch_size=8, sampler=sampler), **_settings(2, None))
    expected = dict(model.named_parameters(remove_duplicate=False))
    for rank, result in enumerate(got):
        for name, value in result.items():
            torch.testing.assert_close(
                value, expected[name].detach(), atol=TOL, rtol=0, msg=f"rank {rank}: {name}"
            )
    assert {n for r in got for n in r} == set(expected)


def too_few_layers_worker() -> str:
    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, schedule="interleaved_1f1b", virtual_stages=4, timeout=timedelta(seconds=60)
    )
    try:
        fit(Regressor(), strategy, 2, loader(TRAIN, 8, reference=False), **_settings(1, None))
    except Exception as err:  # the message is what the test checks
        return str(err)
    return "no error"


def test_too_few_layers_for_the_stages_names_virtual_stages() -> None:
    for message in run_distributed(too_few_layers_worker, 2, timeout=120, init_group=False):
        assert "7 pipeline layers but interleaved 1F1B asks for pipeline_parallel_size (2) x" in message
        assert "virtual_stages (4) = 8 stages" in message and "Lower virtual_stages" in message
