"""Failures end the job with a message that says where, never a hang.

Single process: bad layer outputs, a stage output without a grad path, NaN detection. Real
processes (gloo): a rank that stops sending, a stage whose output changes shape mid-run, and a user
exception on the middle stage of pp=3 under Trainer.fit; every rank must exit non-zero on its own
within the test's deadline, with the expected message, and none may need killing.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import PipeTPStrategy
from lightning_pipe.batches.microbatch import signature
from lightning_pipe.execution import PipelineExecutor
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.schedule import build_schedule
from lightning_pipe.schedule.actions import ActionType, PipelineSchedule
from tests.distributed import Outcome, run_distributed_outcomes
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit

CPU = torch.device("cpu")


def _one_stage(layers: list[nn.Module], **kw: Any) -> PipelineExecutor:
    return PipelineExecutor({0: layers}, 1, [0], CPU, **kw)


def test_layer_returning_a_non_tensor_names_the_layer() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"x": x}

    with pytest.raises(
        TypeError, match=r"Layer 1 \(Bad\) of pipeline stage 0 returned dict.*tensor or a non-empty tuple"
    ):
        apply_layers([nn.Linear(2, 2), Bad()], torch.ones(1, 2))


def test_stage_output_without_grad_path_is_refused() -> None:
    class FreshLeaf(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x, requires_grad=True)

    executor = PipelineExecutor({0: [nn.Linear(2, 2), FreshLeaf()]}, 2, [0, 1], CPU)
    with pytest.raises(
        RuntimeError, match=r"Output 0 of pipeline stage 0 requires grad but has no grad path"
    ) as info:
        executor.run(build_schedule("1f1b", 2, 2), 0, inputs=[torch.ones(1, 2)] * 2)
    assert any("forward of stage 0, micro-batch 0" in n for n in getattr(info.value, "__notes__", []))


def test_nan_detection_names_stage_and_microbatch() -> None:
    class NanOnThird(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x[:, :1] > 2.5, torch.nan, x)

    layers = [nn.Identity(), NanOnThird(), nn.Linear(2, 1)]
    inputs = [torch.full((2, 2), float(i + 1)) for i in range(4)]
    head = lambda out, i: out.mean()  # noqa: E731
    with pytest.raises(
        FloatingPointError, match=r"first appeared in the output of pipeline stage 0 for micro-batch 2"
    ):
        _one_stage(layers, check_finite=True).run(build_schedule("gpipe", 1, 4), 0, inputs=inputs, head=head)
    # Off by default: the same run completes (with a NaN loss).
    result = _one_stage(layers).run(build_schedule("gpipe", 1, 4), 0, inputs=inputs, head=head)
    assert torch.isnan(result.outputs[2])


# ---------------------------------------------------------------------------- multi-process


def _assert_all_failed(outcomes: list[Outcome], patterns: dict[int, str], within: float) -> None:
    for o in outcomes:
        assert not o.killed, f"rank {o.rank} had to be killed: it hung"
        assert o.exitcode not in (None, 0), f"rank {o.rank} exited {o.exitcode}"
        assert o.seconds < within, f"rank {o.rank} took {o.seconds:.1f}s to stop"
        if o.rank in patterns:
            assert o.error is not None and re.search(patterns[o.rank], o.error, re.S), o.error


def _stage(rank: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1)]
    return layers[:2] if rank == 0 else layers[2:]


def stalled_sender_worker() -> None:
    rank = dist.get_rank()
    executor = PipelineExecutor({rank: _stage(rank)}, 2, [0, 1], CPU, timeout=timedelta(seconds=3))
    schedule = build_schedule("1f1b", 2, 2)
    inputs = [torch.ones(2, 4), torch.ones(2, 4)]
    head = lambda out, i: out.pow(2).mean()  # noqa: E731
    if rank == 1:
        # Simulate a rank that stops sending: it never sends its input gradients...
        faulty = tuple(a for a in schedule.actions[1] if a.kind is not ActionType.SEND_B)
        broken = PipelineSchedule(schedule.name, 2, 2, schedule.stage_to_rank, (schedule.actions[0], faulty))
        executor.run(broken, 1, head=head)
    # ... so rank 0 waits for a gradient, and rank 1 waits for the next step's activations.
    executor.run(schedule, rank, inputs=inputs if rank == 0 else None, head=head if rank == 1 else None)


@pytest.mark.distributed
def test_a_rank_that_stops_sending_ends_the_job_at_the_deadline() -> None:
    outcomes = run_distributed_outcomes(stalled_sender_worker, 2, timeout=60)
    _assert_all_failed(
        outcomes,
        {
            0: r"PipelineCommunicationError: Pipeline rank 0 \(global rank 0, stages \[0\]\) gave up on "
            r"receiving the output gradient of stage 0, micro-batch 0 \(RECV_B0\.0\) "
            r"with peer rank 1 after 3\.\ds",
            1: r"gave up on receiving the activation of stage 1, micro-batch 0 \(RECV_F1\.0\)"
            r"(?: \(header\))? with peer rank 0",
        },
        within=30,
    )


class GrowsOnSecondStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.cat([x, x], dim=1) if self.calls > 2 else x


def shape_change_worker() -> None:
    rank = dist.get_rank()
    layers: list[nn.Module] = [nn.Linear(4, 4), GrowsOnSecondStep()] if rank == 0 else [nn.Linear(4, 1)]
    executor = PipelineExecutor({rank: layers}, 2, [0, 1], CPU, timeout=timedelta(seconds=90))
    schedule = build_schedule("gpipe", 2, 2)
    inputs = [torch.ones(2, 4), torch.ones(2, 4)]
    for _ in range(2):
        executor.run(
            schedule, rank,
            inputs=inputs if rank == 0 else None,
            head=(lambda out, i: out.mean()) if rank == 1 else None,
            signatures=[signature(x) for x in inputs],
        )  # fmt: skip


@pytest.mark.distributed
def test_an_output_that_changes_shape_mid_run_is_reported_with_both_shapes() -> None:
    outcomes = run_distributed_outcomes(shape_change_worker, 2, timeout=60)
    _assert_all_failed(
        outcomes,
        {
            0: r"sending the activation of stage 0, micro-batch 0.*changed shape or dtype.*"
            r"it was \[\(\(2, 4\), torch.float32\)\] and is now \[\(\(2, 8\), torch.float32\)\]",
            1: r"with peer rank 0 .*rank 0 has stopped",
        },
        within=45,  # the dead peer is noticed at once, long before the 90 s deadline
    )


class BoomOnStage1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 5:
            raise ValueError("boom: user code failed on the middle stage")
        return self.fc(x)


class Boom(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.layers[2] = BoomOnStage1()

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)


def user_exception_worker() -> None:
    model = Boom()
    strategy = PipeTPStrategy(
        pipeline_parallel_size=3, partition=[2, 2, 3], num_microbatches=2, timeout=timedelta(seconds=90)
    )
    data = loader(dataset(40, seed=1), 8, reference=False)
    fit(model, strategy, 3, data, max_epochs=1, num_sanity_val_steps=0)


@pytest.mark.distributed
def test_user_exception_on_the_middle_stage_stops_every_rank() -> None:
    outcomes = run_distributed_outcomes(user_exception_worker, 3, timeout=120, init_group=False)
    _assert_all_failed(
        outcomes,
        {
            1: r"ValueError: boom: user code failed on the middle stage.*"
            r"Pipeline rank 1 \(global rank 1, stages \[1\]\) was running "
            r"the forward of stage 1, micro-batch 0",
            0: r"with peer rank 1 .*rank 1 \(dp_rank 0, pp_rank 1, tp_rank 0\) raised ValueError: boom",
            2: r"with peer rank 1 .*rank 1 \(dp_rank 0, pp_rank 1, tp_rank 0\) raised ValueError: boom",
        },
        within=60,  # the dead peer is noticed at once, long before the 90 s deadline
    )
