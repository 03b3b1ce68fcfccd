"""The layout planner (issue 47, first part): candidates, the cost model on costs written by hand
whose answer is known by construction, the measurements, and ``python -m lightning_pipe.plan``.

Single process and fast: nothing here starts a process group.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.partition.profile import profile_layers
from lightning_pipe.planning import (
    Candidate,
    Constraints,
    DataMode,
    LayerCost,
    Links,
    Machine,
    ModelCosts,
    ModelShape,
    NothingFitsError,
    Prediction,
    enumerate_candidates,
    plan_layout,
    predict,
    render,
    why,
)
from lightning_pipe.planning.costs import GB
from lightning_pipe.planning.measure import _fixed, accepted_tensor_sizes, parameter_bytes, plan_splits
from lightning_pipe.schedule.builders import ScheduleKind, build_schedule
from lightning_pipe.schedule.shared_cores import simulate_shared
from lightning_pipe.schedule.simulate import simulate

FREE_LINKS = Links(p2p_bandwidth=1e30, p2p_latency=0.0, collective_bandwidth=1e30, collective_latency=0.0)


def _costs(
    layers: int = 8, params: int = 1000, activations: int = 10, f: float = 1.0, b: float = 2.0
) -> ModelCosts:
    """``layers`` equal layers, ``f`` and ``b`` seconds per sample (no fixed part)."""
    layer = LayerCost(f, b, activation_bytes=activations, output_bytes=1, parameter_bytes=params)
    return ModelCosts((layer,) * layers, rows=1)


# ----------------------------------------------------------------------------- candidates
def test_candidates_divide_the_world_and_respect_the_model() -> None:
    shape = ModelShape(num_layers=4, tensor_parallel_sizes=frozenset({1, 2}))
    found = enumerate_candidates(8, shape, batch=8, constraints=Constraints())
    sizes = {(c.pipeline_parallel_size, c.tensor_parallel_size, c.data_parallel_size) for c in found}
    # pp=8 has more stages than layers, tp=4 and 8 are not accepted by the model.
    assert sizes == {(1, 1, 8), (2, 1, 4), (4, 1, 2), (1, 2, 4), (2, 2, 2), (4, 2, 1)}
    for c in found:
        assert c.num_stages <= 4
        assert 8 % c.data_parallel_size == 0 and (8 // c.data_parallel_size) % c.num_microbatches == 0
        if c.data_parallel_size == 1:
            assert c.data_mode is DataMode.REPLICATED
        if c.pipeline_parallel_size == 1:
            assert (c.schedule, c.virtual_stages) == (ScheduleKind.ONE_F_ONE_B, 1)
        if c.schedule is ScheduleKind.INTERLEAVED_1F1B:
            assert c.virtual_stages >= 2 and c.pipeline_parallel_size >= 2
        else:
            assert c.virtual_stages == 1
        if c.reshard_after_forward:
            assert c.data_mode is DataMode.FSDP2 and not c.schedule.splits_backward
    assert {c.data_mode for c in found} == set(DataMode)
    assert {c.recompute for c in found} == {RecomputeMode.NEVER, RecomputeMode.ALWAYS}
    assert any(c.schedule is ScheduleKind.INTERLEAVED_1F1B and c.virtual_stages == 2 for c in found)
    assert len(found) == len(set(found))


def test_a_schedule_running_the_actions_of_another_is_listed_once() -> None:
    """With one micro-batch GPipe and 1F1B run the same actions on every rank: one candidate, named
    1F1B (two would rank one layout twice). With two micro-batches they differ and both stay; a
    schedule the user named is kept."""
    shape = ModelShape(num_layers=4, tensor_parallel_sizes=frozenset({1}))
    found = enumerate_candidates(2, shape, batch=2, constraints=Constraints(recompute="never"))
    kinds = {
        m: {c.schedule for c in found if c.num_microbatches == m and c.virtual_stages == 1} for m in (1, 2)
    }
    kinds = {m: {k for k in ks if k is not ScheduleKind.ZB_H1} for m, ks in kinds.items()}
    assert kinds == {1: {ScheduleKind.ONE_F_ONE_B}, 2: {ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE}}
    assert any(c.schedule is ScheduleKind.ZB_H1 and c.num_microbatches == 1 for c in found)  # splits B
    # The rule is the built schedules': equal actions with one micro-batch, not with two.
    for pp in (2, 3, 4):
        for m, same in ((1, True), (2, False)):
            gpipe, one_f_one_b = build_schedule("gpipe", pp, m), build_schedule("1f1b", pp, m)
            assert (gpipe.actions == one_f_one_b.actions) is same
    named = enumerate_candidates(
        2, shape, batch=2, constraints=Constraints(schedule="gpipe", num_microbatches=1)
    )
    assert {(c.pipeline_parallel_size, c.schedule) for c in named} == {
        (1, ScheduleKind.GPIPE),
        (2, ScheduleKind.GPIPE),
    }


def test_the_sizes_a_user_set_are_kept() -> None:
    shape = ModelShape(num_layers=8, tensor_parallel_sizes=frozenset({1, 2, 4}))
    fixed = Constraints(
        pipeline_parallel_size=2, data_mode="zero1", num_microbatches=2, recompute="never", schedule="1f1b"
    )
    found = enumerate_candidates(8, shape, batch=16, constraints=fixed)
    assert found
    assert {
        (c.pipeline_parallel_size, c.data_mode, c.num_microbatches, c.recompute, c.schedule) for c in found
    } == {(2, DataMode.ZERO1, 2, RecomputeMode.NEVER, ScheduleKind.ONE_F_ONE_B)}
    assert {c.tensor_parallel_size for c in found} == {1, 2, 4}


@pytest.mark.parametrize(
    "constraints, batch, words",
    [
        (Constraints(pipeline_parallel_size=3), 8, "pipeline_parallel_size=3"),
        (Constraints(tensor_parallel_size=4), 8, "tensor_parallel_size=4"),
        (Constraints(num_microbatches=3), 8, "num_microbatches=3"),
        (Constraints(pipeline_parallel_size=1, schedule="zb_h1"), 8, "'zb_h1'"),
    ],
)
def test_a_constraint_no_layout_meets_is_named(constraints: Constraints, batch: int, words: str) -> None:
    shape = ModelShape(num_layers=4, tensor_parallel_sizes=frozenset({1, 2}))
    with pytest.raises(ValueError, match=re.escape(words)):
        enumerate_candidates(8, shape, batch, constraints)


def test_constraints_are_checked() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        Constraints(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="data mode must be one of"):
        Constraints(data_mode="zero3")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the cost model
def test_the_schedule_bubble_comes_from_the_simulator() -> None:
    """4 stages of 2 layers (forward 2 s, backward 4 s per micro-batch of one sample), 1F1B with
    4 micro-batches: (m + p - 1)(t_f + t_b) = 7 x 6 = 42 s, of which 18 s are bubble."""
    c = Candidate(4, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 4, RecomputeMode.NEVER)
    p = predict(c, _costs(), Machine(4, 1e12, FREE_LINKS), batch=4)
    assert p.step_seconds == pytest.approx(42.0)
    assert p.compute_seconds == pytest.approx(24.0)
    assert p.bubble_seconds == pytest.approx(18.0)
    # Recomputation runs each forward again in backward: (m + p - 1)(2 t_f + t_b) = 7 x 8.
    again = predict(
        replace(c, recompute=RecomputeMode.ALWAYS), _costs(), Machine(4, 1e12, FREE_LINKS), batch=4
    )
    assert again.step_seconds == pytest.approx(56.0)
    assert again.recompute_seconds == pytest.approx(8.0)


def test_processes_sharing_cores_lend_the_bubble_only_while_others_compute() -> None:
    """4 processes on 2 cores (``compute_slots=2``), 4 layers of 1 + 2 s per sample, a batch of 4.
    dp=4 (one sample each) keeps all four busy for 12 s of their own work: on 2 cores, 24 s.
    pp=4 with 4 micro-batches is 7 x 3 = 21 s on devices of its own (9 s of it bubble), and its
    48 s of work in all cannot run faster than 24 s on 2 cores. While a rank waits in the bubble
    the others use its core, but only while two or more others compute: the warm-up's first
    forward and the cool-down's last backward run alone, a core idle, while the steady state runs
    four at once at half speed. The schedule played that way (``simulate_shared``) lies above
    both bounds and below every computation at half speed (42 s). On devices of their own the
    pipeline loses by 21 s against 12 s; sharing the cores, by much less."""
    dp4 = Candidate(1, 1, 4, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
    pp4 = Candidate(4, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 4, RecomputeMode.NEVER)
    costs = _costs(layers=4)
    own = Machine(4, 1e12, FREE_LINKS)
    shared = Machine(4, 1e12, FREE_LINKS, compute_slots=2)
    assert predict(dp4, costs, own, 4).step_seconds == pytest.approx(12.0)
    assert predict(pp4, costs, own, 4).step_seconds == pytest.approx(21.0)
    assert predict(dp4, costs, shared, 4).step_seconds == pytest.approx(24.0)
    pipeline = predict(pp4, costs, shared, 4)
    played = simulate_shared(build_schedule("1f1b", 4, 4), 1.0, 2.0, 0.0, slots=2.0)
    assert 24.0 < played.makespan < 42.0
    assert pipeline.step_seconds == pytest.approx(played.makespan)
    assert pipeline.shared_compute_seconds == pytest.approx(played.makespan - 21.0)
    # As many slots as processes: nothing shared, the devices' prediction.
    assert predict(pp4, costs, replace(shared, compute_slots=4), 4).step_seconds == pytest.approx(21.0)
    # Tensor parallelism's all-reduces are waits the links' probe timed with every process on the
    # cores: sharing them does not slow them again, and each waits the machine's
    # collective_wait_seconds more for its last rank. tp=4 over 2 cores, 4 samples through 4
    # layers whose work the plan splits: 12 s of compute and 4 x 2 all-reduces of 0.6 s per rank;
    # the compute of 4 ranks over 2 cores takes 24 s, the all-reduces 4.8 s on top: 28.8 s (paced
    # as work, 2 x 16.8 = 33.6 s). Waiting 0.1 s more each: 8 x 0.7 = 5.6 s of all-reduces.
    layer = LayerCost(1.0, 2.0, output_bytes=1000, parameter_bytes=1000, split_parameter_bytes=1000,
                      tensor_forward_collectives=1, tensor_backward_collectives=1)  # fmt: skip
    slow = Links(collective_bandwidth=1e4, collective_latency=0.0, p2p_bandwidth=1e30, p2p_latency=0.0)
    tp4 = Candidate(1, 4, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
    four = ModelCosts((layer,) * 4, rows=1)
    split = predict(tp4, four, Machine(4, 1e12, slow, compute_slots=2), 4)
    assert split.tensor_seconds == pytest.approx(4 * 2 * 0.6)
    assert split.step_seconds == pytest.approx(24.0 + 4.8)
    assert split.shared_compute_seconds == pytest.approx(28.8 - 16.8)
    waiting = predict(tp4, four, Machine(4, 1e12, slow, compute_slots=2, collective_wait_seconds=0.1), 4)
    assert waiting.tensor_seconds == pytest.approx(8 * 0.7)
    assert waiting.step_seconds == pytest.approx(24.0 + 5.6)
    # With recomputation the replayed forward's all-reduces are waits too: 4 more of 0.7 s.
    again = predict(
        replace(tp4, recompute=RecomputeMode.ALWAYS),
        four,
        Machine(4, 1e12, slow, compute_slots=2, collective_wait_seconds=0.1),
        4,
    )
    assert again.step_seconds == pytest.approx(2 * (12.0 + 4.0) + 12 * 0.7)
    with pytest.raises(ValueError, match="collective_wait_seconds must be a number of seconds >= 0"):
        Machine(4, 1e12, collective_wait_seconds=-1.0)


def test_each_message_between_stages_and_each_data_collective_waits_for_its_last_rank() -> None:
    """pp=2, one micro-batch of 1 sample through 2 layers of 1 + 2 s, on devices of their own: F0,
    its output to stage 1, F1, B1, the gradient back, B0: 6 s and two messages on the critical
    path, each 0.25 s longer with ``collective_wait_seconds=0.25``. dp=2 replicated, one
    all-reduce of the gradients after the backward (not hidden on CPU): 0.25 s more. ZeRO-1:
    a reduce-scatter and an all-gather, 0.5 s more. FSDP2 without resharding: a gather and a
    reduction per layer, 2 layers: 1 s more, one micro-batch."""
    costs, free = _costs(layers=2), replace(FREE_LINKS, overlap_data_parallel=False)
    pp2 = Candidate(2, 1, 1, DataMode.REPLICATED, ScheduleKind.GPIPE, 1, 1, RecomputeMode.NEVER)
    dp2 = Candidate(1, 1, 2, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)

    def step(c: Candidate, wait: float) -> float:
        machine = Machine(2, 1e12, free, collective_wait_seconds=wait)
        return predict(c, costs, machine, batch=c.data_parallel_size).step_seconds  # 1 sample a replica

    assert step(pp2, 0.0) == pytest.approx(6.0)
    assert step(pp2, 0.25) == pytest.approx(6.5)
    for mode, collectives in ((DataMode.REPLICATED, 1), (DataMode.ZERO1, 2), (DataMode.FSDP2, 4)):
        c = replace(dp2, data_mode=mode)
        assert step(c, 0.25) - step(c, 0.0) == pytest.approx(0.25 * collectives), mode
    with pytest.raises(ValueError, match="compute_slots must be a positive number"):
        Machine(4, 1e12, compute_slots=0)


def test_fsdp2_pays_a_collectives_latency_per_layer() -> None:
    """FSDP2 makes each pipeline layer a unit of its own, gathered and reduced by its own
    collective; ZeRO-1's buckets (one here) make one. Links of 1 s latency a ring step and no
    bandwidth cost, nothing overlapped, free compute, 4 layers over 4 data ranks (3 ring steps):
    ZeRO-1's reduce-scatter and all-gather 2 x 3 = 6 s; FSDP2 without resharding 4 layers x
    (gather + reduce) = 24 s; resharding, per micro-batch 4 x (gather, gather, reduce) = 36 s."""
    layer = LayerCost(0.0, 0.0, parameter_bytes=1000)
    costs = ModelCosts((layer,) * 4, rows=1)
    slow = Links(collective_bandwidth=1e30, collective_latency=1.0, overlap_data_parallel=False)

    def data(mode: DataMode, reshard: bool = False, m: int = 1) -> float:
        c = Candidate(1, 1, 4, mode, ScheduleKind.ONE_F_ONE_B, 1, m, RecomputeMode.NEVER, reshard)
        return predict(c, costs, Machine(4, 1e12, slow), 8).data_seconds

    assert data(DataMode.ZERO1) == pytest.approx(6.0)
    assert data(DataMode.FSDP2) == pytest.approx(24.0)
    assert data(DataMode.FSDP2, reshard=True) == pytest.approx(36.0)
    assert data(DataMode.FSDP2, reshard=True, m=2) == pytest.approx(72.0)


def test_reduce_scatter_and_all_gather_measured_apart_are_used_where_given() -> None:
    """A backend need not run a reduce-scatter or an all-gather as half a ring all-reduce (gloo on
    CPU: a reduce-scatter as long as an all-reduce): rates measured apart replace the all-reduce's.
    Links of 1 s a ring step for the all-reduce and none for the bytes, 4 data ranks (3 steps),
    one layer, nothing overlapped: ZeRO-1 is 3 + 3 = 6 s read from the all-reduce; a reduce-scatter
    of 4 s a step and an all-gather of 2 s a step make it 12 + 6 = 18 s; FSDP2 (one unit) too.
    A measured bandwidth is used for the bytes: 3/4 of 1000 bytes at 250 B/s is 3 s more."""
    costs = ModelCosts((LayerCost(0.0, 0.0, parameter_bytes=1000),), rows=1)
    ring = Links(collective_bandwidth=1e30, collective_latency=1.0, overlap_data_parallel=False)
    apart = replace(ring, reduce_scatter_latency=4.0, all_gather_latency=2.0)

    def data(links: Links, mode: DataMode = DataMode.ZERO1) -> float:
        c = Candidate(1, 1, 4, mode, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
        return predict(c, costs, Machine(4, 1e12, links), 8).data_seconds

    assert data(ring) == pytest.approx(6.0)
    assert data(apart) == pytest.approx(18.0)
    assert data(apart, DataMode.FSDP2) == pytest.approx(18.0)
    assert data(replace(apart, reduce_scatter_bandwidth=250.0)) == pytest.approx(21.0)
    assert apart.all_reduce(1000, 4) == ring.all_reduce(1000, 4)  # the all-reduce keeps its own
    with pytest.raises(ValueError, match="all_gather_bandwidth must be a positive"):
        Links(all_gather_bandwidth=0.0)


def test_each_step_pays_the_runtimes_own_collectives_at_the_links_latency() -> None:
    """The runtime's batch agreement (2 all-reduces over the pp x tp replica) and, with a pipeline,
    the results sent from the last stage (3 broadcasts over the pipeline ranks), latency alone.
    Links of 1 s a ring step, free bytes and messages, free compute: pp=4 pays 2 x 6 + 3 x 3 =
    21 s; pp=2 x tp=2 2 x 6 + 3 x 1 = 15 s; tp=4 2 x 6 = 12 s; pp=1 x dp=4 nothing (no replica
    of several ranks, no pipeline: its data axis' latency is the data part's)."""
    costs = ModelCosts((LayerCost(0.0, 0.0, parameter_bytes=1000),) * 4, rows=1)
    links = Links(p2p_bandwidth=1e30, p2p_latency=0.0, collective_bandwidth=1e30, collective_latency=1.0,
                  overlap_data_parallel=False)  # fmt: skip

    def made(pp: int, tp: int, dp: int) -> Prediction:
        c = Candidate(pp, tp, dp, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
        return predict(c, costs, Machine(4, 1e12, links), 4)

    assert made(4, 1, 1).step_collectives_seconds == pytest.approx(21.0)
    assert made(4, 1, 1).step_seconds == pytest.approx(21.0)
    assert made(2, 2, 1).step_collectives_seconds == pytest.approx(15.0)
    assert made(1, 4, 1).step_collectives_seconds == pytest.approx(12.0)
    dp4 = made(1, 1, 4)
    assert dp4.step_collectives_seconds == 0.0 and dp4.step_seconds == pytest.approx(dp4.data_seconds)


def test_the_optimizer_step_follows_the_schedule_on_the_parameters_a_rank_updates() -> None:
    """4 layers whose optimizer step takes 1 s each over their whole parameters, free compute:
    a replica steps all 4 (4 s), ZeRO-1 and FSDP2 over 4 data ranks a quarter each (1 s), a
    4-stage pipeline its one layer (1 s); 4 processes stepping at once on 2 cores take twice as long."""
    layer = LayerCost(0.0, 0.0, parameter_bytes=1000, optimizer_seconds=1.0)
    costs = ModelCosts((layer,) * 4, rows=1)
    machine = Machine(4, 1e12, FREE_LINKS)

    def step(pp: int, dp: int, mode: DataMode, on: Machine = machine) -> float:
        c = Candidate(
            pp, 1, dp, mode, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER, mode is DataMode.FSDP2
        )
        p = predict(c, costs, on, 4)
        assert p.step_seconds == pytest.approx(p.optimizer_seconds)
        return p.step_seconds

    assert step(1, 4, DataMode.REPLICATED) == pytest.approx(4.0)
    assert step(1, 4, DataMode.ZERO1) == pytest.approx(1.0)
    assert step(1, 4, DataMode.FSDP2) == pytest.approx(1.0)
    assert step(4, 1, DataMode.REPLICATED) == pytest.approx(1.0)
    assert step(4, 1, DataMode.REPLICATED, replace(machine, compute_slots=2)) == pytest.approx(2.0)
    # Tensor parallelism steps a tensor rank's slice: half of a fully split layer at tp=2.
    split = replace(layer, split_parameter_bytes=1000)
    c = Candidate(1, 2, 2, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
    assert predict(c, ModelCosts((split,) * 4, rows=1), machine, 4).optimizer_seconds == pytest.approx(2.0)


def test_the_optimizer_step_is_timed_per_layer() -> None:
    """A stand-in optimizer whose step sleeps 20 ms: each layer with parameters measures at least
    that (the first step, creating the state, is not timed), one without none."""
    from lightning_pipe.planning.measure import measure_model, optimizer_seconds

    class Sleepy(torch.optim.SGD):
        steps = 0

        def step(self, closure: object = None) -> None:  # type: ignore[override]
            Sleepy.steps += 1
            time.sleep(0.02)

    layers = [nn.Linear(4, 4), nn.ReLU()]
    assert optimizer_seconds(layers[1], lambda ps: Sleepy(ps, lr=0.1), torch.device("cpu")) == 0.0
    costs = measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=2,
                          optimizer=lambda ps: Sleepy(ps, lr=0.1))  # fmt: skip
    # The first layer only (1 + 2 repeats), then the DTensor probe: plain and DTensor steps, 1 + 2 each.
    assert Sleepy.steps == 3 + 2 * 3
    assert 0.02 <= costs.layers[0].optimizer_seconds < 0.2
    assert costs.layers[1].optimizer_seconds == 0.0
    assert (
        measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=1)
        .layers[0]
        .optimizer_seconds
        == 0.0
    )  # not asked: not measured


def test_fsdp2_pays_dtensors_dispatch_per_parameter_tensor() -> None:
    """4 layers of 10 parameter tensors, a DTensor step 1 ms a tensor over plain tensors' (AdamW's
    own time 0), free compute and links, 4 data ranks. FSDP2 steps all 40 tensors on each rank
    (sharded, but as many): 40 ms; its hooks a third of that per tensor and collective: one gather
    and one reduction without resharding (26.7 ms), two gathers and a reduction per micro-batch
    resharding (40 ms x 2 micro-batches); on 2 cores for 4 processes, twice each. ZeRO-1 steps
    plain tensors: nothing."""
    from lightning_pipe.planning.cost_model import FSDP_GATHER_SHARE, FSDP_REDUCE_SHARE

    layer = LayerCost(0.0, 0.0, parameter_bytes=1000, parameter_tensors=10)
    costs = ModelCosts((layer,) * 4, rows=1, sharded_step_seconds=1e-3)

    def made(mode: DataMode, reshard: bool = False, m: int = 1, machine: Machine | None = None) -> Prediction:
        c = Candidate(1, 1, 4, mode, ScheduleKind.ONE_F_ONE_B, 1, m, RecomputeMode.NEVER, reshard)
        return predict(c, costs, machine or Machine(4, 1e12, FREE_LINKS), 8)

    kept = made(DataMode.FSDP2)
    assert kept.optimizer_seconds == pytest.approx(0.040)
    assert kept.data_seconds == pytest.approx(0.040 * (FSDP_GATHER_SHARE + FSDP_REDUCE_SHARE))
    assert kept.step_seconds == pytest.approx(0.040 * (1 + 2 / 3))
    resharded = made(DataMode.FSDP2, reshard=True, m=2)
    assert resharded.data_seconds == pytest.approx(0.040 * 2 * (2 * FSDP_GATHER_SHARE + FSDP_REDUCE_SHARE))
    shared = made(DataMode.FSDP2, machine=Machine(4, 1e12, FREE_LINKS, compute_slots=2))
    assert shared.step_seconds == pytest.approx(2 * kept.step_seconds)
    assert made(DataMode.ZERO1).step_seconds == pytest.approx(0.0, abs=1e-12)


def test_the_dtensor_step_overhead_is_measured_on_one_process() -> None:
    """A stand-in optimizer whose step sleeps 2 ms for every DTensor it steps (and nothing for a
    plain tensor): the overhead per tensor is those 2 ms, measured without a process group; the
    layers' parameter tensors are counted."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_pipe.planning.measure import measure_model, sharded_step_overhead

    class PerDTensor(torch.optim.SGD):
        def step(self, closure: object = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    if isinstance(p.data, DTensor) or isinstance(p, DTensor):
                        time.sleep(0.002)

    overhead = sharded_step_overhead(lambda ps: PerDTensor(ps, lr=0.1), torch.device("cpu"), tensors=8)
    assert 0.002 <= overhead < 0.01
    assert not dist.is_initialized()
    real = sharded_step_overhead(lambda ps: torch.optim.AdamW(ps), torch.device("cpu"), tensors=8)
    assert 0.0 <= real < 0.05  # AdamW over DTensors costs more, not an unbounded amount
    costs = measure_model([nn.Linear(4, 4), nn.ReLU()], lambda r: torch.randn(r, 4), 2, torch.device("cpu"),
                          repeats=1, optimizer=lambda ps: PerDTensor(ps, lr=0.1))  # fmt: skip
    assert [layer.parameter_tensors for layer in costs.layers] == [2, 0]
    assert costs.sharded_step_seconds >= 0.002


def test_the_dtensor_probe_runs_only_where_a_candidate_shards_parameters() -> None:
    """The DTensor step probe (about a second) is skipped where no FSDP2 candidate can be planned
    (one process, dp fixed to 1, another data mode fixed), and still run where one can: through
    ``layout='auto'``'s own measurement (one process: no FSDP2) and the helper it asks."""
    from lightning_pipe.planning import auto as planning_auto
    from lightning_pipe.planning import measure

    shape = ModelShape(num_layers=2)
    assert planning_auto.needs_sharded_step(4, shape, 4, Constraints())
    assert planning_auto.needs_sharded_step(4, shape, 4, Constraints(data_mode=DataMode.FSDP2))
    assert not planning_auto.needs_sharded_step(1, shape, 4, Constraints())
    assert not planning_auto.needs_sharded_step(4, shape, 4, Constraints(data_parallel_size=1))
    assert not planning_auto.needs_sharded_step(4, shape, 4, Constraints(data_mode=DataMode.ZERO1))
    assert not planning_auto.needs_sharded_step(4, shape, 4, Constraints(data_mode=DataMode.REPLICATED))
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with mock.patch.object(measure, "sharded_step_overhead", return_value=0.001) as probe:
        plan = planning_auto.decide_layout(
            layers, lambda r: torch.randn(r, 4), 4, torch.device("cpu"), 1e9, shape, Constraints(), repeats=1
        )
        assert plan.best is not None and probe.call_count == 0
        measure.measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=1,
                              optimizer=measure.adamw, sharded=False)  # fmt: skip
        assert probe.call_count == 0
        costs = measure.measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=1,
                                      optimizer=measure.adamw)  # fmt: skip
        assert probe.call_count == 1 and costs.sharded_step_seconds == 0.001


def test_the_split_backward_is_timed_only_where_a_candidate_is_zero_bubble() -> None:
    """The split backward's timing (two more forwards and backwards a layer) is skipped where no
    ZB-H1 candidate can be planned (one process, pp fixed to 1, another schedule fixed), and run
    where one can: through ``layout='auto'``'s own measurement (one process: no pipeline) and the
    profiler's flag."""
    from lightning_pipe.partition import profile as profile_module
    from lightning_pipe.planning import auto as planning_auto
    from lightning_pipe.planning import measure

    shape = ModelShape(num_layers=2)
    assert planning_auto.needs_split_backward(4, shape, 4, Constraints())
    assert planning_auto.needs_split_backward(4, shape, 4, Constraints(schedule="zb_h1"))
    assert not planning_auto.needs_split_backward(1, shape, 4, Constraints())
    assert not planning_auto.needs_split_backward(4, shape, 4, Constraints(pipeline_parallel_size=1))
    assert not planning_auto.needs_split_backward(4, shape, 4, Constraints(schedule="1f1b"))
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with mock.patch.object(profile_module, "_split_ratio", return_value=1.25) as timing:
        plan = planning_auto.decide_layout(
            layers, lambda r: torch.randn(r, 4), 4, torch.device("cpu"), 1e9, shape, Constraints(), repeats=1
        )
        assert plan.best is not None and timing.call_count == 0
        costs = measure.measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=1,
                                      split_backward=False)  # fmt: skip
        assert timing.call_count == 0 and {c.split_backward_ratio for c in costs.layers} == {1.0}
        costs = measure.measure_model(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), repeats=1)
        # Each layer's ratio once a round, at the measured rows only.
        assert timing.call_count == 2 * measure.MEASURED_ROUNDS
        assert {c.split_backward_ratio for c in costs.layers} == {1.25}


def test_layer_times_are_the_median_of_rounds_taken_in_turns() -> None:
    """Each size is profiled once a round, the sizes in turn, and a layer's time is the median over
    the rounds: one round spoiled by other work on the host (here 10x) moves nothing."""
    from lightning_pipe.partition.profile import LayerTime
    from lightning_pipe.planning import measure

    calls: list[int] = []
    spoiled = {1: 10.0}  # the second round's profiles

    def profile(layers: Any, sample: torch.Tensor, device: Any, repeats: int, split_backward: bool) -> Any:
        rows = sample.shape[0]
        slow = spoiled.get(len(calls) // 3, 1.0)  # three sizes a round
        calls.append(rows)
        return [
            LayerTime(slow * rows * (i + 1), slow * 2 * rows * (i + 1), saved_bytes=rows,
                      split_backward_ratio=1.5 if split_backward else 1.0)
            for i in range(len(layers))
        ]  # fmt: skip

    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    with mock.patch.object(measure, "profile_layers", side_effect=profile):
        costs = measure.measure_layers(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), sizes=[8],
                                       rounds=3)  # fmt: skip
    assert calls == [2, 4, 8] * 3  # in turns, not one size's rounds back to back
    assert [c.forward_seconds for c in costs] == [2.0, 4.0]
    assert [c.backward_seconds for c in costs] == [4.0, 8.0]
    assert [c.timings for c in costs] == [((4, 4.0, 8.0), (8, 8.0, 16.0)), ((4, 8.0, 16.0), (8, 16.0, 32.0))]
    assert {c.split_backward_ratio for c in costs} == {1.5} and costs[0].activation_bytes == 2
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        measure.measure_layers(layers, lambda r: torch.randn(r, 4), 2, torch.device("cpu"), rounds=0)


def test_compute_slots_are_the_cores_over_the_threads_on_cpu() -> None:
    from lightning_pipe.planning.measure import compute_slots

    with mock.patch("os.cpu_count", return_value=2):
        assert compute_slots(torch.device("cpu"), 4, threads=1) == 2.0
        assert compute_slots(torch.device("cpu"), 1, threads=1) == 1.0  # never more than the processes
        assert compute_slots(torch.device("cpu"), 4, threads=4) == 1.0  # at least one
    assert compute_slots(torch.device("meta"), 4) is None  # an accelerator: a device per process


def test_with_free_communication_and_a_large_bubble_data_parallelism_wins() -> None:
    """A batch of 4 on 4 processes: pipelines can have at most 4 micro-batches, so their bubble is
    large; data parallelism splits the batch with no bubble, and its communication costs nothing
    here. The winner is dp=4, predicted at exactly a quarter of one device's 8 x 3 x 4 s."""
    plan = plan_layout(_costs(), Machine(4, 1e12, FREE_LINKS), ModelShape(8), batch=4)
    best = plan.chosen()
    assert (best.candidate.pipeline_parallel_size, best.candidate.data_parallel_size) == (1, 4)
    assert best.step_seconds == pytest.approx(24.0)
    assert best.candidate.recompute is RecomputeMode.NEVER
    pipelines = [p for p in plan.predictions if p.candidate.pipeline_parallel_size > 1]
    assert min(p.step_seconds for p in pipelines) > 24.0
    assert "won" in why(plan) and str(best.candidate) in why(plan)


def test_slow_data_links_make_the_pipeline_win() -> None:
    """The same model with a data axis whose all-reduce takes longer than the whole step: now the
    pipeline (point-to-point messages cost nothing) beats every data-parallel layout."""
    slow = Links(p2p_bandwidth=1e30, p2p_latency=0.0, collective_bandwidth=1.0, collective_latency=0.0)
    plan = plan_layout(_costs(), Machine(4, 1e12, slow), ModelShape(8), batch=4)
    best = plan.chosen()
    assert (best.candidate.pipeline_parallel_size, best.candidate.data_parallel_size) == (4, 1)
    assert best.data_seconds == 0.0


def test_with_memory_too_small_for_replicas_a_pipeline_is_chosen() -> None:
    """8 layers of 1 GB of parameters, AdamW (2 bytes of state per parameter byte): a replica
    needs 8 + 8 + 16 = 32 GB, ZeRO-1 over 4 ranks 20 GB, FSDP2 resharding (8 + 8 + 16) / 4 + 3 =
    11 GB, a 4-stage pipeline 2 + 2 + 4 = 8 GB (plus tiny activations). With 10 GB only the
    4-stage pipeline fits, although data parallelism would be faster."""
    costs = _costs(params=10**9)
    roomy = plan_layout(costs, Machine(4, 1e12, FREE_LINKS), ModelShape(8), batch=4).chosen()
    assert roomy.candidate.data_parallel_size == 4
    plan = plan_layout(costs, Machine(4, 10 * GB, FREE_LINKS), ModelShape(8), batch=4)
    best = plan.chosen()
    assert best.candidate.pipeline_parallel_size == 4 and best.fits
    assert best.peak_bytes <= 10 * GB
    assert {p.candidate.pipeline_parallel_size for p in plan.fitting} == {4}
    by_mode = {
        (p.candidate.data_mode, p.candidate.reshard_after_forward): p.memory
        for p in plan.predictions
        if p.candidate.data_parallel_size == 4
        and p.candidate.num_microbatches == 1
        and p.candidate.recompute is RecomputeMode.NEVER
    }
    replicated = by_mode[(DataMode.REPLICATED, False)]
    assert (replicated.parameters, replicated.gradients, replicated.optimizer) == (8 * GB, 8 * GB, 16 * GB)
    assert by_mode[(DataMode.ZERO1, False)].optimizer == 4 * GB
    sharded = by_mode[(DataMode.FSDP2, True)]
    assert sharded.parameters + sharded.gradients + sharded.optimizer == pytest.approx(11 * GB)
    assert "need more than 10 GB per rank" in why(plan)


def test_between_equal_times_less_traffic_wins_before_less_memory() -> None:
    """Data-parallel traffic that hides entirely behind backward: every dp=4 layout is predicted
    equally fast, FSDP2's resharding holds the least memory, but it gathers the parameters twice
    per micro-batch; ZeRO-1 moves what a replicated all-reduce moves and keeps a quarter of the
    optimizer state, so it wins, for that reason."""
    hidden = Links(collective_bandwidth=1e12, collective_latency=0.0, overlap_data_parallel=True)
    fixed = Constraints(data_parallel_size=4, num_microbatches=2, recompute="never")
    plan = plan_layout(_costs(params=10**6), Machine(4, 1e12, hidden), ModelShape(8), 8, fixed)
    assert all(p.data_seconds == 0.0 for p in plan.predictions)
    by_mode = {(p.candidate.data_mode, p.candidate.reshard_after_forward): p for p in plan.predictions}
    resharded = by_mode[(DataMode.FSDP2, True)]
    assert resharded.peak_bytes < by_mode[(DataMode.ZERO1, False)].peak_bytes
    assert resharded.data_traffic_seconds > by_mode[(DataMode.ZERO1, False)].data_traffic_seconds
    assert plan.chosen().candidate.data_mode is DataMode.ZERO1
    assert "as fast as pp=1, dp=4 replicated" in why(plan) and "lower peak memory" in why(plan)


def test_when_the_cores_are_the_bottleneck_the_shorter_schedule_is_faster() -> None:
    """4 processes on 2 cores, a 4-stage 1F1B pipeline of 1 + 2 s per sample and stage, a batch of
    8: all ranks' work, 4 x 8 x 3 = 96 s, over 2 cores is 48 s whatever the micro-batches, longer
    than either schedule (m=4: 7 x 6 = 42 s; m=8: 11 x 3 = 33 s). Both take longer than 48 s: in
    the warm-up and cool-down fewer than 2 ranks compute and a core idles. m=8 wins: its
    schedule on devices of its own is shorter, so fewer of its computations run with a core idle
    (on a host with more cores, it is the faster too). When only the work over the cores
    counted, the two tied at 48 s and the tie-break on the schedule chose m=8; before that
    tie-break, the simpler m=4 won."""
    fixed = Constraints(pipeline_parallel_size=4, schedule="1f1b", recompute="never")
    machine = Machine(4, 1e12, FREE_LINKS, compute_slots=2)
    costs = ModelCosts(
        (LayerCost(1.0, 2.0, parameter_bytes=1000),) * 4, rows=1
    )  # no activations: equal peaks
    plan = plan_layout(costs, machine, ModelShape(4), 8, fixed)
    by_m = {p.candidate.num_microbatches: p for p in plan.predictions}
    assert 48.0 < by_m[8].step_seconds < by_m[4].step_seconds
    assert by_m[4].peak_bytes == by_m[8].peak_bytes
    assert plan.chosen().candidate.num_microbatches == 8
    assert by_m[4].schedule_seconds == pytest.approx(42.0) and by_m[8].schedule_seconds == pytest.approx(33.0)
    # Over every layout, those tied with the best (48 s) differ in how they reach it: the winner is
    # the one waiting least for the cores (pp=2 x dp=2 at one micro-batch: its bubble lends them).
    free = plan_layout(costs, machine, ModelShape(4), 8, Constraints(recompute="never"))
    best = free.chosen()
    tied = [p for p in free.fitting if p.step_seconds <= best.step_seconds * (1 + 1e-6)]
    assert len(tied) > 1 and best.shared_compute_seconds == min(p.shared_compute_seconds for p in tied)
    assert max(p.shared_compute_seconds for p in tied) > best.shared_compute_seconds


def test_ties_go_to_the_shorter_wait_for_cores_then_schedule_then_less_memory_then_fewer_processes() -> None:
    """Equal predicted steps, nothing moved between replicas: the shorter wait for shared cores
    wins (fewer processes computing at once: measured faster in every tie the benchmark met), then
    the shorter schedule on devices of their own, then the lower peak, then the layout whose
    collectives span fewer processes (tp x dp); the line under the table says which decided."""
    from lightning_pipe.planning.cost_model import MemoryUse
    from lightning_pipe.planning.planner import ranked

    def made(tp: int, dp: int, peak: float, shared: float = 0.0, step: float = 1.0) -> Prediction:
        c = Candidate(4 // (tp * dp), tp, dp, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 4,
                      RecomputeMode.NEVER)  # fmt: skip
        use = MemoryUse(peak, 0.0, 0.0, 0.0)
        return Prediction(
            c, step, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, use, (use,), True, shared_compute_seconds=shared
        )

    # On shared cores: the one waiting less for them wins, although its schedule is the longer
    # (0.8 s against 0.5 s) and its peak the higher.
    plan = ranked([made(1, 2, 1.0, shared=0.5), made(1, 4, 2.0, shared=0.2)], 10.0, 4)
    assert plan.chosen().candidate.data_parallel_size == 4
    assert "shorter wait for shared cores (0.2 s against 0.5 s" in why(plan)
    # On devices of their own (no wait for cores): the shorter schedule, inside the half percent.
    plan = ranked([made(1, 2, 1.0), made(1, 4, 2.0, step=0.998)], 10.0, 4)
    assert plan.chosen().candidate.data_parallel_size == 4
    assert "shorter schedule on devices of their own (0.998 s against 1 s: less bubble)" in why(plan)
    plan = ranked([made(1, 4, 2.0), made(1, 2, 1.0)], 10.0, 4)
    assert plan.chosen().candidate.data_parallel_size == 2 and "lower peak memory" in why(plan)
    plan = ranked([made(2, 2, 1.0), made(1, 4, 1.0), made(1, 2, 1.0)], 10.0, 4)
    assert [p.communicating_processes for p in plan.predictions] == [2, 4, 4]
    assert "collectives over fewer processes (2 against 4)" in why(plan)
    # Within half a percent is a tie too (closer than any measurement here): the slightly slower
    # prediction with the shorter wait for cores wins; one 1% slower does not.
    near = made(1, 4, 1.0, shared=0.1, step=1.004)
    plan = ranked([made(1, 2, 1.0, shared=0.2), near], 10.0, 4)
    assert plan.chosen() is near and "as fast as" in why(plan)
    far = replace(near, step_seconds=1.01)
    assert ranked([made(1, 2, 1.0, shared=0.2), far], 10.0, 4).chosen() is not far
    # The tie is measured from the fastest, not from the winner: dp=4 with m=2 (1.004) wins the
    # group of dp=4 with m=4 (1.000) on its wait for cores; tp=2 x dp=2 at 1.008, 0.8% over the
    # fastest, was not in the group: slower, not "as fast as" the winner.
    same = made(1, 4, 1.0, shared=0.5)
    waits_less = replace(
        made(1, 4, 1.0, shared=0.4, step=1.004), candidate=replace(same.candidate, num_microbatches=2)
    )
    slower = made(2, 2, 1.0, step=1.008)
    plan = ranked([same, waits_less, slower], 10.0, 4)
    assert plan.chosen() is waits_less and "as fast as" not in why(plan) and "faster than" in why(plan)


def test_every_prediction_is_ranked_once_when_rounded_steps_straddle_the_tie() -> None:
    """Two steps equal to six digits, one each side of the half-percent bound, with the one over
    it first by the tie-breaks: each prediction still appears once in the plan."""
    from lightning_pipe.planning.cost_model import MemoryUse
    from lightning_pipe.planning.planner import ranked

    def made(microbatches: int, step: float, shared: float) -> Prediction:
        c = Candidate(4, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, microbatches,
                      RecomputeMode.NEVER)  # fmt: skip
        use = MemoryUse(1.0, 0.0, 0.0, 0.0)
        return Prediction(
            c, step, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, use, (use,), True, shared_compute_seconds=shared
        )

    first, over, under = made(1, 1.0, 0.0), made(2, 1.0050004, 0.0), made(4, 1.0049996, 0.5)
    plan = ranked([first, over, under], 10.0, 8)
    assert sorted(id(p) for p in plan.predictions) == sorted(id(p) for p in (first, over, under))
    assert plan.predictions[-1] is over


def test_when_nothing_fits_one_sentence_gives_the_need_and_the_limit() -> None:
    costs = _costs(params=10**9)
    plan = plan_layout(costs, Machine(4, 1 * GB, FREE_LINKS), ModelShape(8), batch=4)
    assert plan.best is None
    least = min(plan.predictions, key=lambda p: p.peak_bytes)
    assert (
        plan.refusal
        == f"needs {least.peak_bytes / GB:.3g} GB per rank at best ({least.candidate}), the limit is 1 GB"
    )
    assert least.peak_bytes > 1 * GB
    assert re.fullmatch(r"needs [0-9.]+ GB per rank at best \(pp=.*\), the limit is 1 GB", plan.refusal or "")
    with pytest.raises(NothingFitsError, match=re.escape(plan.refusal or "")):
        plan.chosen()
    assert why(plan).startswith("Nothing fits: the model needs")


def test_tensor_parallelism_pays_only_when_its_all_reduces_are_cheap() -> None:
    """Layers whose work the plan splits entirely: with free links tp=4 is as fast as dp=4 and
    holds a quarter of the parameters, so it wins on memory; with slow links its all-reduces
    (every layer, every micro-batch) lose to the data axis, whose traffic hides behind backward."""
    layer = LayerCost(
        1.0,
        2.0,
        activation_bytes=10,
        output_bytes=1000,
        parameter_bytes=1000,
        split_parameter_bytes=1000,
        tensor_forward_collectives=1,
        tensor_backward_collectives=1,
    )
    costs = ModelCosts((layer,) * 4, rows=1)
    shape = ModelShape(4, frozenset({1, 2, 4}))
    fixed = Constraints(
        pipeline_parallel_size=1, num_microbatches=1, recompute="never", data_mode="replicated"
    )
    free = plan_layout(costs, Machine(4, 1e12, FREE_LINKS), shape, 4, fixed).chosen()
    assert free.candidate.tensor_parallel_size == 4
    slow = Links(collective_bandwidth=1e4, collective_latency=0.0, p2p_bandwidth=1e30, p2p_latency=0.0)
    plan = plan_layout(costs, Machine(4, 1e12, slow), shape, 4, fixed)
    assert plan.chosen().candidate.tensor_parallel_size == 1
    tp4 = next(p for p in plan.predictions if p.candidate.tensor_parallel_size == 4)
    # 4 layers x 2 all-reduces of the hidden states of 4 samples (4000 bytes) over 4 ranks:
    # 2 x 3/4 x 4000 / 1e4 = 0.6 s each.
    assert tp4.tensor_seconds == pytest.approx(4 * 2 * 0.6)


def test_the_report_shows_the_top_five() -> None:
    plan = plan_layout(_costs(), Machine(4, 1e12, FREE_LINKS), ModelShape(8), batch=8)
    text = render(plan)
    rows = [line for line in text.splitlines() if re.match(r"\d+\s", line)]
    assert len(rows) == 5
    assert rows[0].split()[0] == "1" and str(plan.predictions[0].candidate) in rows[0]
    assert "peak/rank" in text


# ----------------------------------------------------------------------------- measurements
def test_the_profiler_counts_saved_activations_and_outputs() -> None:
    """A Linear saves its input (its weight is left out), a ReLU its output."""
    times = profile_layers([nn.Linear(16, 32), nn.ReLU()], torch.randn(4, 16), torch.device("cpu"), repeats=1)
    assert [t.saved_bytes for t in times] == [4 * 16 * 4, 4 * 32 * 4]
    assert [t.output_bytes for t in times] == [4 * 32 * 4, 4 * 32 * 4]
    assert [(t.saved_input_bytes, t.saved_output_bytes) for t in times] == [(4 * 16 * 4, 0), (0, 4 * 32 * 4)]


def test_the_profiler_times_the_split_backward_against_an_ordinary_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split backward (I, then W) as zero-bubble schedules run it, timed against an ordinary
    backward of its own forward, on a clock the test drives (so that the machine's load cannot
    move it): each reading advances 1 ms, and the I pass 20 ms more. An ordinary backward reads
    1 ms, a split one 21 ms: 21x. The model's own layers get no gradient; without
    ``split_backward`` the ratio is 1 (not measured); ``measure_layers`` passes it on."""
    import lightning_pipe.partition.profile as profile_module
    from lightning_pipe.planning.measure import measure_layers

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1e-3
            return self.now

    clock = Clock()
    real = profile_module.backward_input

    def slow_input_pass(*args: object, **kwargs: object) -> object:
        clock.now += 20e-3
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profile_module, "time", clock)
    monkeypatch.setattr(profile_module, "backward_input", slow_input_pass)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)]
    timed = profile_layers(layers, torch.randn(2, 8), torch.device("cpu"), repeats=2, split_backward=True)
    assert [t.split_backward_ratio for t in timed] == pytest.approx([21.0, 21.0, 21.0]), timed
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    plain = profile_layers(layers, torch.randn(2, 8), torch.device("cpu"), repeats=1)
    assert [t.split_backward_ratio for t in plain] == [1.0, 1.0, 1.0]
    costs = measure_layers(layers, lambda r: torch.randn(r, 8), 2, torch.device("cpu"), repeats=1)
    assert [c.split_backward_ratio for c in costs] == pytest.approx([21.0, 21.0, 21.0]), costs


def test_zero_bubble_schedules_pay_the_measured_split_backward() -> None:
    """Layers whose split backward costs 1.5x an ordinary one: ZB-H1's backward per stage is 1.5x
    (its input and weight passes each half of that), 1F1B's is not; with a large bubble ZB-H1
    still fills it, so the prediction is the simulator's with those times."""
    layer = LayerCost(1.0, 2.0, parameter_bytes=100, output_bytes=1, split_backward_ratio=1.5)
    costs = ModelCosts((layer,) * 4, rows=1)
    machine = Machine(4, 1e12, FREE_LINKS)
    one_f = Candidate(4, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 4, RecomputeMode.NEVER)
    zero = replace(one_f, schedule=ScheduleKind.ZB_H1)
    assert predict(one_f, costs, machine, 4).step_seconds == pytest.approx(
        simulate(build_schedule("1f1b", 4, 4), 1.0, 2.0).makespan
    )
    assert predict(zero, costs, machine, 4).step_seconds == pytest.approx(
        simulate(build_schedule("zb_h1", 4, 4), 1.0, 3.0).makespan
    )
    with pytest.raises(ValueError, match="split_backward_ratio must be > 0"):
        LayerCost(1.0, 2.0, split_backward_ratio=0.0)


@pytest.mark.parametrize("kind, alive", [("gpipe", 4), ("1f1b", 1)])
def test_predicted_activations_are_the_executors_own_count(kind: str, alive: int) -> None:
    """One stage run by the engine's executor, its activation meter on: the bytes it counts for
    the micro-batches alive at once are the planner's prediction from the profiler's counts (a
    tensor two neighbouring layers both save counted once), plus the one weight autograd keeps for
    the input gradient, which the planner counts with the parameters."""
    from lightning_pipe.batches.microbatch import signature
    from lightning_pipe.execution.executor import PipelineExecutor
    from lightning_pipe.planning.measure import measure_model

    torch.manual_seed(0)
    width, rows = 64, 32
    stage = [nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width), nn.Tanh()]
    executor = PipelineExecutor({0: stage}, 1, [0], torch.device("cpu"))
    executor.measure_activation_memory = True
    inputs = [torch.randn(rows, width) for _ in range(4)]
    result = executor.run(
        build_schedule(kind, 1, 4), 0, inputs=inputs, head=lambda y, i: y.square().mean(),
        signatures=[signature(x) for x in inputs],
    )  # fmt: skip
    assert result.peak_stashed == alive
    costs = measure_model(stage, lambda r: torch.randn(r, width), rows, torch.device("cpu"), repeats=1)
    c = Candidate(1, 1, 1, DataMode.REPLICATED, ScheduleKind(kind), 1, 4, RecomputeMode.NEVER)
    predicted = predict(c, costs, Machine(1, 1e12), batch=4 * rows)
    kept_weight = width * width * 4  # the second Linear's, for its input gradient
    assert predicted.memory.activations == result.peak_activation_bytes - kept_weight


@pytest.mark.parametrize("ends_in", ["Tanh", "Linear"])
def test_zero_bubble_recomputation_holds_each_replayed_forward_until_its_weight_pass(ends_in: str) -> None:
    """ZB-H1 with recomputation on one stage of 4 micro-batches: each input-gradient pass runs
    the forward again, and what that forward saved (and its output, the weight pass's root) is held
    until the weight pass. The executor's meter (stage inputs and outputs kept, plus the replay)
    is the planner's prediction plus the weight autograd keeps for the input gradient, whether the
    stage's last layer saves its output (Tanh) or not (Linear)."""
    from lightning_pipe.batches.microbatch import signature
    from lightning_pipe.execution.executor import PipelineExecutor
    from lightning_pipe.planning.measure import measure_model

    torch.manual_seed(0)
    width, rows = 64, 32

    def stage() -> list[nn.Module]:
        last = [nn.Tanh()] if ends_in == "Tanh" else []
        return [nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width), *last]

    executor = PipelineExecutor({0: stage()}, 1, [0], torch.device("cpu"), recompute="always")
    executor.measure_activation_memory = True
    inputs = [torch.randn(rows, width) for _ in range(4)]
    result = executor.run(
        build_schedule("zb_h1", 1, 4), 0, inputs=inputs, head=lambda y, i: y.square().mean(),
        signatures=[signature(x) for x in inputs],
    )  # fmt: skip
    costs = measure_model(stage(), lambda r: torch.randn(r, width), rows, torch.device("cpu"), repeats=1)
    c = Candidate(1, 1, 1, DataMode.REPLICATED, ScheduleKind.ZB_H1, 1, 4, RecomputeMode.ALWAYS)
    predicted = predict(c, costs, Machine(1, 1e12), batch=4 * rows)
    kept_weight = width * width * 4  # the second Linear's, for its input gradient
    assert predicted.memory.activations == result.peak_held_bytes - kept_weight
    # More than the stage input and output kept per micro-batch: the replay is counted.
    assert predicted.memory.activations > 2 * rows * width * 4


def test_the_fixed_part_of_a_time() -> None:
    assert _fixed(1.0, 1.5) == pytest.approx(0.5)  # doubling the rows added 0.5 s: 0.5 s is fixed
    assert _fixed(1.0, 3.0) == 0.0  # noise: more than doubled
    assert _fixed(1.0, 0.5) == 1.0  # noise: faster on more rows


def test_a_micro_batch_is_timed_from_the_sizes_measured_nearest_it() -> None:
    """A layer measured at 2 samples (1 + 2 s, no fixed part), 4 (2 + 4 s) and 16 (32 + 64 s: its
    time per sample quadruples once the micro-batch is large). One device, one 16-sample
    micro-batch: the measured 96 s, where the line through 2 and 4 samples says 24 s; 8 samples lie
    on the line between 4 and 16 (6 s, and 4/12 of the 90 s between); 1 sample on the line from
    the fixed part through 2 samples; 32, the largest measured's time per sample."""
    layer = LayerCost(1.0, 2.0, parameter_bytes=1000, timings=((16, 32.0, 64.0), (4, 2.0, 4.0)))
    assert layer.timings == ((4, 2.0, 4.0), (16, 32.0, 64.0))  # sorted
    costs = ModelCosts((layer,), rows=2)
    one = Machine(1, 1e12, FREE_LINKS)

    def step(batch: int) -> float:
        c = Candidate(1, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
        return predict(c, costs, one, batch).step_seconds

    assert step(16) == pytest.approx(96.0)
    assert step(8) == pytest.approx(6.0 + 90.0 * 4 / 12)
    assert step(1) == pytest.approx(1.5)
    assert step(32) == pytest.approx(192.0)
    # A tensor rank doing half the work of a layer whose parameters are all split: half the time
    # past the fixed part.
    fixed = replace(layer, forward_fixed_seconds=0.5, backward_fixed_seconds=0.5)
    assert fixed.seconds_at(16, 2, share=0.5) == pytest.approx((0.5 + 31.5 / 2, 0.5 + 63.5 / 2))
    with pytest.raises(ValueError, match="timings must be"):
        LayerCost(1.0, 2.0, timings=((0, 1.0, 1.0),))
    with pytest.raises(ValueError, match="each micro-batch size once"):
        LayerCost(1.0, 2.0, timings=((4, 2.0, 4.0), (4, 3.0, 3.0)))
    # A timing at the measured size is that measurement, not a second point beside it.
    again = LayerCost(1.0, 2.0, timings=((2, 3.0, 3.0), (4, 2.0, 4.0)))
    assert again.seconds_at(2.1, 2) == pytest.approx(
        LayerCost(1.0, 2.0, timings=((4, 2.0, 4.0),)).seconds_at(2.1, 2)
    )


def test_a_larger_micro_batch_never_takes_less_time_past_the_largest_measured() -> None:
    """Noise on a layer that costs little more per sample than per call: 4 samples measured
    faster than 2 (the fixed part then is the whole of the 2-sample time). Past 4 samples the time
    holds, where the line from the fixed part through 4 samples fell below zero."""
    layer = LayerCost(
        1.0, 1.0, forward_fixed_seconds=1.0, backward_fixed_seconds=1.0, timings=((4, 0.9, 0.9),)
    )
    times = [sum(layer.seconds_at(rows, 2)) for rows in (4, 8, 16, 64)]
    assert times == pytest.approx([1.8, 1.8, 1.8, 1.8])


def test_the_layers_are_timed_at_the_candidates_micro_batch_sizes() -> None:
    """The sizes a batch of 16 on 4 processes runs are 1, 2, 4, 8 and 16 samples: measured at 2
    (and 4, for the fixed part), the layers are also timed at 1, 8 and 16 (at most five sizes, the
    largest always), and a layer whose time grows faster than its rows (a stand-in profiler) is
    predicted at 16 samples as measured there."""
    from lightning_pipe.partition.profile import LayerTime
    from lightning_pipe.planning.candidates import microbatch_rows
    from lightning_pipe.planning.measure import measure_model, measurement_sizes

    candidates = enumerate_candidates(4, ModelShape(4), 16, Constraints())
    needed = microbatch_rows(candidates, 16)
    assert needed == [1, 2, 4, 8, 16]
    assert measurement_sizes(needed, 2) == [1, 8, 16]
    assert measurement_sizes([1, 2, 4, 8, 16, 32, 64, 128], 2) == [1, 16, 128]  # spread, largest kept
    assert measurement_sizes([1, 2, 4, 8, 16, 32, 64, 128], 2, limit=3) == [128]

    timed: list[int] = []

    def profile(
        layers: list[nn.Module],
        sample: torch.Tensor,
        device: torch.device,
        repeats: int,
        split_backward: bool = False,
    ) -> list:
        rows = sample.shape[0]
        timed.append(rows)
        return [LayerTime(rows * rows * 1e-3, 2 * rows * rows * 1e-3) for _ in layers]

    with mock.patch("lightning_pipe.planning.measure.profile_layers", profile):
        costs = measure_model([nn.Linear(4, 4)], lambda r: torch.randn(r, 4), 2, torch.device("cpu"),
                              sizes=measurement_sizes(needed, 2), rounds=1)  # fmt: skip
    assert sorted(timed) == [1, 2, 4, 8, 16]
    c = Candidate(1, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 1, RecomputeMode.NEVER)
    assert predict(c, costs, Machine(1, 1e12, FREE_LINKS), 16).step_seconds == pytest.approx(3 * 16 * 16e-3)


def test_parameter_bytes_and_the_plans_splits_on_the_meta_device() -> None:
    from lightning_pipe.construction.meta import parameters_on_meta
    from tests.gpt_models import DIM, VOCAB, TinyGPT

    with parameters_on_meta():
        model = TinyGPT()
    layers = model.configure_pipeline()
    assert all(p.is_meta for p in model.parameters())
    block = 4 * (
        2 * 2 * DIM
        + 3 * DIM * DIM
        + 3 * DIM
        + DIM * DIM
        + DIM
        + 4 * DIM * DIM
        + 4 * DIM
        + 4 * DIM * DIM
        + DIM
    )
    assert parameter_bytes(layers[1]) == block
    sizes, splits = accepted_tensor_sizes(model, layers, lambda t: model.tensor_parallel_plan(), 8)
    assert sizes == {1, 2, 4}  # 4 heads: 8 tensor ranks would split a head
    block_split = splits[2][1]
    assert block_split.parameter_bytes == block - 4 * 4 * DIM  # all but the two norms
    assert (block_split.forward_collectives, block_split.backward_collectives) == (2, 2)
    assert splits[2][0].parameter_bytes == 4 * VOCAB * DIM  # the token embedding, not the positions
    no_plan = accepted_tensor_sizes(model, layers, lambda t: None, 8)
    assert no_plan == (frozenset({1}), {})
    assert plan_splits(model, layers, {}) == [splits[2][0].__class__()] * 4


# ----------------------------------------------------------------------------- the command
def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from lightning_pipe.plan import main

    code = main(list(argv))
    return code, capsys.readouterr().out


def test_the_command_plans_a_tiny_gpt(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(
        capsys,
        "tests.gpt_models:TinyGPT",
        "--devices",
        "4",
        "--memory",
        "1GB",
        "--batch",
        "8",
        "--seq",
        "8",
        "--repeats",
        "1",
    )
    assert code == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\d+\s+pp=", line)]
    assert len(rows) == 5, out
    assert " won: " in out
    code, out = _run(
        capsys,
        "tests.gpt_models:TinyGPT",
        "--devices",
        "4",
        "--memory",
        "1GB",
        "--batch",
        "8",
        "--seq",
        "8",
        "--repeats",
        "1",
        "--pipeline-parallel-size",
        "2",
        "--json",
    )
    ranked = json.loads(out)
    assert ranked[-1] == {"why": None}
    assert ranked[:-1] and all(p["candidate"]["pipeline_parallel_size"] == 2 for p in ranked[:-1])


def test_the_command_refuses_a_constraint_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_pipe.plan import main

    argv = ["tests.gpt_models:TinyGPT", "--devices", "4", "--memory", "1GB", "--batch", "8", "--seq", "8"]
    with mock.patch("lightning_pipe.plan.measure_model", side_effect=AssertionError("measured")):
        assert main([*argv, "--pipeline-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "No layout of 4 processes meets pipeline_parallel_size=3" in err


def test_the_command_refuses_bad_numbers_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_pipe.plan import main

    argv = ["tests.gpt_models:TinyGPT", "--devices", "4", "--memory", "1GB", "--batch", "8", "--seq", "8"]
    for option, value, expected in (
        ("--collective-wait", "-1", "expected a number >= 0, got '-1'"),
        ("--latency", "abc", "expected a number >= 0, got 'abc'"),
        ("--bandwidth", "0", "expected a number > 0, got '0'"),
    ):
        with mock.patch("lightning_pipe.plan.measure_model", side_effect=AssertionError("measured")):
            with pytest.raises(SystemExit) as exited:
                main([*argv, option, value])
        assert exited.value.code == 2
        assert f"argument {option}: {expected}" in capsys.readouterr().err


def test_the_commands_collective_wait_lengthens_each_tensor_all_reduce(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One layout (tp=2 x dp=2, one micro-batch): its tensor-parallel all-reduces take a whole
    number of milliseconds more with ``--collective-wait 1000`` (one each), at least one."""
    argv = ["tests.gpt_models:TinyGPT", "--devices", "4", "--memory", "1GB", "--batch", "8", "--seq", "8",
            "--repeats", "1", "--json", "--pipeline-parallel-size", "1", "--tensor-parallel-size", "2",
            "--num-microbatches", "1", "--recompute", "never", "--data-mode", "replicated"]  # fmt: skip
    tensor = []
    for wait in ("0", "1000"):
        code, out = _run(capsys, *argv, "--collective-wait", wait)
        assert code == 0, out
        (only, refusal) = json.loads(out)
        assert refusal == {"why": None}
        tensor.append(only["tensor_seconds"])
    added = (tensor[1] - tensor[0]) / 1e-3
    assert added >= 1 and added == pytest.approx(round(added), abs=1e-6)


def test_the_command_plans_a_tiny_llama_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.hf_models import tiny_config

    tiny_config().save_pretrained(tmp_path)
    code, out = _run(
        capsys,
        str(tmp_path),
        "--devices",
        "4",
        "--memory",
        "1GB",
        "--batch",
        "8",
        "--seq",
        "8",
        "--repeats",
        "1",
        "--tensor-parallel-size",
        "2",
    )
    assert code == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\d+\s+pp=", line)]
    assert rows and all("tp=2" in row for row in rows), out
    # 2 key-value heads: 4 tensor ranks are refused by the model's own plan check.
    code, out = _run(
        capsys,
        str(tmp_path / "config.json"),
        "--devices",
        "4",
        "--memory",
        "1KB",
        "--batch",
        "8",
        "--seq",
        "8",
        "--repeats",
        "1",
    )
    assert code == 1
    assert "Nothing fits: the model needs" in out and "the limit is 1 kB." in out
    assert "tp=4" not in out


# ----------------------------------------------------------------------------- the links' probe
def test_the_links_fit_recovers_latency_and_bandwidth() -> None:
    from lightning_pipe.planning.links import LARGE_BYTES, SMALL_BYTES, _fit

    latency, bandwidth, units = 30e-6, 2e9, 1.5  # an all-reduce over 4 ranks moves 2 x 3/4 of the bytes
    small, large = (latency + n * units / bandwidth for n in (SMALL_BYTES, LARGE_BYTES))
    assert _fit(small, large, units) == (pytest.approx(latency), pytest.approx(bandwidth))
    assert _fit(1e-3, 1e-3, 1.0)[1] == pytest.approx(LARGE_BYTES / 1e-3)  # noise: no slope


def test_compute_slots_from_the_probes_times() -> None:
    from lightning_pipe.planning.cores import slots_from_times

    assert slots_from_times(0.01, 0.02, 4) == pytest.approx(2.0)  # 4 processes, 2 cores
    assert slots_from_times(0.01, 0.04, 4) == pytest.approx(1.0)  # one core's worth left to them
    assert slots_from_times(0.01, 0.01, 4) == pytest.approx(4.0)  # a device each
    assert slots_from_times(0.01, 0.005, 4) == 4.0  # noise: never more than the processes
    # Together slower than one alone (caches thrashed, other jobs): less than one process' worth.
    assert slots_from_times(0.01, 0.1, 4) == pytest.approx(0.4)


def test_compute_slots_take_the_mean_of_the_rounds_together() -> None:
    """A step pays its slow stretches in proportion: one round in four 1.5x longer (the scheduler
    putting 3 of 4 processes on one of 2 cores) counts, where a median would read the fast rounds
    only. Alone is the median, as the layers are timed."""
    from lightning_pipe.planning.cores import slots_from_rounds

    alone, together = [0.09, 0.09, 0.2], [0.2, 0.2, 0.2, 0.3]
    assert slots_from_rounds(alone, together, 4) == pytest.approx(4 * 0.09 / 0.225)
    assert slots_from_rounds([0.09], [0.2, 0.2, 0.2], 4) == pytest.approx(1.8)  # even rounds: as before


def test_links_probed_again_take_each_numbers_median() -> None:
    """Three probes of one group, one taken while other work held the cores (its all-reduce 3x
    slower): each number is the median, so that probe moves nothing. A number one probe lacks
    (measured apart elsewhere) falls back to the all-reduce's, as in a single probe."""
    from lightning_pipe.planning.links import median_links

    fast = Links(1e9, 2e-4, 1e9, 1e-3, False, 3e8, 2e-3, 7e8, 1e-3)
    slow = Links(1e9, 2e-4, 3e8, 3e-3, False, 1e8, 6e-3, 2e8, 3e-3)
    other = Links(2e9, 1e-4, 8e8, 9e-4, False, 4e8, 1e-3, 6e8, 2e-3)
    assert median_links([fast, slow, other]) == Links(1e9, 2e-4, 8e8, 1e-3, False, 3e8, 2e-3, 6e8, 2e-3)
    assert median_links([fast]) == fast
    lacking = replace(other, reduce_scatter_bandwidth=None)
    assert median_links([fast, slow, lacking]).reduce_scatter_bandwidth is None
    with pytest.raises(ValueError, match="at least one probe"):
        median_links([])
    with pytest.raises(ValueError, match="one kind of device"):
        median_links([fast, replace(fast, overlap_data_parallel=True)])


def test_the_wait_at_each_collective_from_the_probes_times() -> None:
    """Per repeat: the work cut into 24 rounds closed by collectives took 0.5 s, in one piece 0.2
    s, the collectives alone 0.18 s: 0.12 s beyond both, 5 ms a collective. The median of the
    repeats (one served badly counts little); noise below zero reads 0."""
    from lightning_pipe.planning.cores import wait_from_times

    assert wait_from_times([0.2], [0.5], [0.18], 24) == pytest.approx(0.005)
    assert wait_from_times([0.2, 0.2, 0.2], [0.5, 0.5, 0.9], [0.18, 0.18, 0.18], 24) == pytest.approx(0.005)
    assert wait_from_times([0.2], [0.3], [0.18], 24) == 0.0
    with pytest.raises(ValueError, match="count must be >= 1"):
        wait_from_times([0.2], [0.5], [0.18], 0)
    with pytest.raises(ValueError, match="one time of each kind per repeat"):
        wait_from_times([0.2, 0.2], [0.5], [0.18], 24)


def _alternating_stretches_worker() -> float:
    """The collective-wait probe over 4 rounds whose late rank alternates: rank 0 sleeps 80 ms in
    even rounds and 20 ms in odd ones, rank 1 the other way round (sleeps: the probe's arithmetic,
    not the cores, is under test)."""
    import torch.distributed as dist

    from lightning_pipe.planning.cores import probe_collective_wait

    late = dist.get_rank() % 2

    def stretch(i: int) -> None:
        time.sleep(0.08 if i % 2 == late else 0.02)

    return probe_collective_wait(torch.device("cpu"), repeats=3, rounds=4, stretch=stretch)


@pytest.mark.distributed
def test_the_collective_wait_probe_reads_the_ranks_arriving_apart() -> None:
    """In one piece each rank works 200 ms; closed by a collective each round waits for the late
    rank, 4 x 80 = 320 ms: 120 ms beyond, 30 ms a collective, the same on both ranks. (A probe
    that forgot to take off the work in one piece would read 80 ms, one that did not divide by the
    collectives 120; the bounds leave room for a loaded machine's late wake-ups.)"""
    from tests.distributed import run_distributed

    waits = run_distributed(_alternating_stretches_worker, 2, timeout=60)
    assert waits[0] == waits[1]
    assert 0.022 <= waits[0] <= 0.045, waits


def _uneven_slots_worker() -> float:
    """The compute-slot probe over work that takes rank 0 50 ms and rank 1 200 ms (sleeps: the
    probe's arithmetic, not the cores, is under test)."""
    import torch.distributed as dist

    from lightning_pipe.planning.cores import probe_compute_slots

    seconds = 0.05 if dist.get_rank() == 0 else 0.2

    def work() -> float:  # returns its seconds, as the probe's work once had to
        start = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - start

    return probe_compute_slots(torch.device("cpu"), repeats=3, work=work)


@pytest.mark.distributed
def test_the_compute_slot_probe_waits_for_the_last_rank_as_a_step_does() -> None:
    """Together lasts until the slowest rank is done: 50 ms alone on rank 0, 200 ms for the group
    together, so 2 x 50 / 200 = 0.5 slots. (The mean of each rank's own time, 125 ms, read 0.8:
    on shared cores the ranks the scheduler served first pulled it down, to more slots than cores.)"""
    from tests.distributed import run_distributed

    slots = run_distributed(_uneven_slots_worker, 2, timeout=60)
    assert slots[0] == slots[1]
    assert slots[0] == pytest.approx(0.5, abs=0.1)


WIDTH, ROWS = 64, 32


def _pipeline_stage() -> list[nn.Module]:
    return [nn.Linear(WIDTH, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]


def _probe_and_pipeline_worker() -> tuple[tuple[float, ...], tuple[int, int, int]]:
    """The links' probe, then three steps over the ranks, the executor's activation meter on: 1F1B
    with 4 micro-batches (a stage a rank), interleaved 1F1B with 6 (two stages a rank) and ZB-H1
    with 6, recomputing (a stage a rank); the peak bytes of each on this rank."""
    import torch.distributed as dist

    from lightning_pipe.batches.microbatch import signature
    from lightning_pipe.execution.executor import PipelineExecutor
    from lightning_pipe.planning.cores import probe_collective_wait, probe_compute_slots
    from lightning_pipe.planning.links import probe_links

    links = probe_links(torch.device("cpu"), repeats=2)
    slots = probe_compute_slots(torch.device("cpu"), repeats=1, products=4)
    wait = probe_collective_wait(torch.device("cpu"), repeats=1, rounds=4)
    probed = (links.p2p_bandwidth, links.p2p_latency, links.collective_bandwidth, links.collective_latency,
              float(links.overlap_data_parallel), slots, wait, links.reduce_scatter_bandwidth,
              links.reduce_scatter_latency, links.all_gather_bandwidth, links.all_gather_latency)  # fmt: skip
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    executor = PipelineExecutor({rank: _pipeline_stage()}, p, list(range(p)), torch.device("cpu"))
    executor.measure_activation_memory = True
    inputs = [torch.randn(ROWS, WIDTH) for _ in range(4)]
    result = executor.run(
        build_schedule("1f1b", p, 4), rank, inputs=inputs if rank == 0 else None,
        head=lambda y, i: y.square().mean(), signatures=[signature(x) for x in inputs],
    )  # fmt: skip
    # Two stages a rank (interleaved 1F1B, v=2): stage s on rank s % p.
    interleaved = PipelineExecutor(
        {rank: _pipeline_stage(), rank + p: _pipeline_stage()}, 2 * p, list(range(p)), torch.device("cpu")
    )
    interleaved.measure_activation_memory = True
    six = [torch.randn(ROWS, WIDTH) for _ in range(6)]  # distinct: the meter counts a tensor once
    two = interleaved.run(
        build_schedule("interleaved_1f1b", 2 * p, 6, virtual_stages=2), rank,
        inputs=six if rank == 0 else None, head=lambda y, i: y.square().mean(),
        signatures=[signature(x) for x in six],
    )  # fmt: skip
    # ZB-H1 with recomputation: each input-gradient pass runs the forward again, and that graph
    # is held until the weight pass, which rank r defers by r micro-batches.
    zero = PipelineExecutor(
        {rank: _pipeline_stage()}, p, list(range(p)), torch.device("cpu"), recompute="always"
    )
    zero.measure_activation_memory = True
    held = zero.run(
        build_schedule("zb_h1", p, 6), rank, inputs=six if rank == 0 else None,
        head=lambda y, i: y.square().mean(), signatures=[signature(x) for x in six],
    )  # fmt: skip
    return probed, (result.peak_activation_bytes, two.peak_activation_bytes, held.peak_held_bytes)


@pytest.mark.distributed
def test_the_links_probe_and_pipelines_activations_on_three_ranks() -> None:
    """Every rank gets rank 0's probe of the links and the same probes of the compute slots and the
    wait at each collective; and
    each pipeline rank's activation bytes, as the executor's meter counts them over the
    micro-batches 1F1B keeps alive (3, 2, 1), are the
    planner's prediction (from one stage measured by the profiler, the stages given equal times so
    that the planner splits the layers as the run does) plus the weights autograd keeps for the
    input gradient (one on the first stage, whose input needs none, two on the others). The same
    with two stages a rank (interleaved 1F1B): the rank's peak over its own actions, which the sum
    of its two stages' own peaks overstates."""
    from lightning_pipe.planning.measure import measure_model
    from tests.distributed import run_distributed

    results = run_distributed(_probe_and_pipeline_worker, 3, timeout=120)
    probes = [probe for probe, _ in results]
    one_stage = [peaks[0] for _, peaks in results]
    two_stages = [peaks[1] for _, peaks in results]
    replayed = [peaks[2] for _, peaks in results]
    assert probes[0] == probes[1] == probes[2]
    p2p_bandwidth, p2p_latency, bandwidth, latency, overlap, slots, wait, *halves = probes[0]
    assert p2p_bandwidth > 0 and bandwidth > 0 and p2p_latency >= 0 and latency >= 0
    # Reduce-scatter and all-gather measured apart (bandwidth, latency each), not left to the ring.
    rs_bandwidth, rs_latency, ag_bandwidth, ag_latency = halves
    assert rs_bandwidth > 0 and ag_bandwidth > 0 and rs_latency >= 0 and ag_latency >= 0
    assert overlap == 0.0  # gloo on CPU: the data axis' traffic is not hidden
    assert 0.0 < slots <= 3.0  # the same on every rank (above), a share of the 3 processes
    assert wait >= 0.0  # the same on every rank (above)

    measured = measure_model(
        _pipeline_stage(), lambda r: torch.randn(r, WIDTH), ROWS, torch.device("cpu"), repeats=1
    )
    layers = tuple(replace(layer, forward_seconds=1.0, backward_seconds=2.0, forward_fixed_seconds=0.0,
                           backward_fixed_seconds=0.0) for layer in measured.layers) * 3  # fmt: skip
    costs = replace(measured, layers=layers)
    c = Candidate(3, 1, 1, DataMode.REPLICATED, ScheduleKind.ONE_F_ONE_B, 1, 4, RecomputeMode.NEVER)
    predicted = predict(c, costs, Machine(3, 1e12), batch=4 * ROWS)
    micro_batch = predicted.rank_memory[2].activations  # the last stage keeps one alive
    weight = WIDTH * WIDTH * 4
    kept = [weight, 2 * weight, 2 * weight]
    assert [m.activations for m in predicted.rank_memory] == [
        b - w for b, w in zip(one_stage, kept, strict=True)
    ]
    # Interleaved, two stages a rank, 6 micro-batches: the rank's peak over its actions in order,
    # not the sum of its stages' own peaks (those do not coincide), plus the weights kept for its
    # two stages (stage 0's input needs no gradient).
    c = Candidate(3, 1, 1, DataMode.REPLICATED, ScheduleKind.INTERLEAVED_1F1B, 2, 6, RecomputeMode.NEVER)
    predicted = predict(c, replace(costs, layers=layers * 2), Machine(3, 1e12), batch=6 * ROWS)
    kept = [3 * weight, 4 * weight, 4 * weight]
    assert [m.activations for m in predicted.rank_memory] == [
        b - w for b, w in zip(two_stages, kept, strict=True)
    ]
    peaks = simulate(build_schedule("interleaved_1f1b", 6, 6, virtual_stages=2)).peak_inflight
    stages_own_peaks = (peaks[0] + peaks[3]) * micro_batch
    assert stages_own_peaks > two_stages[0] - kept[0]
    # ZB-H1, recomputing every micro-batch, 6 micro-batches: the kept inputs plus the forwards
    # run again at the input-gradient passes and held until their weight passes.
    c = Candidate(3, 1, 1, DataMode.REPLICATED, ScheduleKind.ZB_H1, 1, 6, RecomputeMode.ALWAYS)
    predicted = predict(c, costs, Machine(3, 1e12), batch=6 * ROWS)
    kept = [weight, 2 * weight, 2 * weight]
    assert [m.activations for m in predicted.rank_memory] == [
        b - w for b, w in zip(replayed, kept, strict=True)
    ]
