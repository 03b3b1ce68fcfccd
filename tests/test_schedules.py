"""Schedules as data: golden action lists, the validator, the simulator and the text rendering.

Everything here runs in one process without torch.distributed: a schedule is a pure value, so its
correctness (every action once, in a legal order, messages that pair up, no deadlock) and its cost
(makespan, bubble, activation memory) are checked on paper.
"""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe.schedule.actions import (
    Action,
    ActionType,
    B,
    F,
    PipelineSchedule,
    ScheduleError,
    comm_batches,
)
from lightning_pipe.schedule.builders import (
    ScheduleKind,
    build_schedule,
    gpipe_compute_order,
    one_f_one_b_compute_order,
)
from lightning_pipe.schedule.lockstep import ReceiveAt, lower
from lightning_pipe.schedule.render import render_schedule
from lightning_pipe.schedule.simulate import match_messages, simulate
from lightning_pipe.schedule.validate import validate_schedule

KINDS = ["gpipe", "1f1b"]


# SEND_F, RECV_F, SEND_B and RECV_B, in the same notation as F and B.
def SF(s: int, i: int) -> Action:
    return Action(s, ActionType.SEND_F, i)


def RF(s: int, i: int) -> Action:
    return Action(s, ActionType.RECV_F, i)


def SB(s: int, i: int) -> Action:
    return Action(s, ActionType.SEND_B, i)


def RB(s: int, i: int) -> Action:
    return Action(s, ActionType.RECV_B, i)


def make(
    actions: list[list[Action]], m: int, training: bool = True, name: str = "hand-made"
) -> PipelineSchedule:
    """A one-stage-per-rank schedule from explicit per-rank lists."""
    p = len(actions)
    return PipelineSchedule(
        name=name,
        num_stages=p,
        num_microbatches=m,
        stage_to_rank=tuple(range(p)),
        actions=tuple(tuple(a) for a in actions),
        training=training,
    )


def compute_only(actions: tuple[Action, ...] | list[Action]) -> list[Action]:
    return [a for a in actions if a.kind.is_compute]


# ---------------------------------------------------------------------------------------- golden


def test_gpipe_p2_m3_exact_actions() -> None:
    schedule = build_schedule("gpipe", 2, 3)
    assert schedule.name == "gpipe"
    assert schedule.stage_to_rank == (0, 1)
    assert schedule.num_ranks == 2
    assert list(schedule.actions[0]) == [
        F(0, 0), SF(0, 0),
        F(0, 1), SF(0, 1),
        F(0, 2), SF(0, 2),
        RB(0, 2), B(0, 2),
        RB(0, 1), B(0, 1),
        RB(0, 0), B(0, 0),
    ]  # fmt: skip
    assert list(schedule.actions[1]) == [
        RF(1, 0), F(1, 0),
        RF(1, 1), F(1, 1),
        RF(1, 2), F(1, 2),
        B(1, 2), SB(1, 2),
        B(1, 1), SB(1, 1),
        B(1, 0), SB(1, 0),
    ]  # fmt: skip


def test_one_f_one_b_p2_m3_exact_actions() -> None:
    schedule = build_schedule("1f1b", 2, 3)
    assert schedule.name == "1f1b"
    assert list(schedule.actions[0]) == [
        F(0, 0), SF(0, 0),
        F(0, 1), SF(0, 1),
        RB(0, 0), B(0, 0),
        F(0, 2), SF(0, 2),
        RB(0, 1), B(0, 1),
        RB(0, 2), B(0, 2),
    ]  # fmt: skip
    assert list(schedule.actions[1]) == [
        RF(1, 0), F(1, 0), B(1, 0), SB(1, 0),
        RF(1, 1), F(1, 1), B(1, 1), SB(1, 1),
        RF(1, 2), F(1, 2), B(1, 2), SB(1, 2),
    ]  # fmt: skip


def test_one_f_one_b_steady_state_batches_send_with_opposite_receive() -> None:
    """SEND_F of one micro-batch and RECV_B of an older one are adjacent: one posted batch."""
    schedule = build_schedule("1f1b", 2, 3)
    batches = comm_batches(schedule.actions[0])
    assert [SF(0, 1), RB(0, 0)] in batches
    assert [SF(0, 2), RB(0, 1)] in batches
    # The peer matches it with its own adjacent SEND_B and RECV_F.
    assert [SB(1, 0), RF(1, 1)] in comm_batches(schedule.actions[1])
    # Compute actions always stand alone.
    assert all(len(b) == 1 for b in batches if b[0].kind.is_compute)


def test_one_f_one_b_p4_m8_rank0_compute_order() -> None:
    expected = (
        [F(0, 0), F(0, 1), F(0, 2)]  # warm-up: min(p - 1 - r, m) = 3
        + [a for i in range(5) for a in (F(0, 3 + i), B(0, i))]  # steady 1F1B
        + [B(0, 5), B(0, 6), B(0, 7)]  # cool-down
    )
    assert one_f_one_b_compute_order(4, 8)[0] == expected
    assert compute_only(build_schedule("1f1b", 4, 8).actions[0]) == expected


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (3, 1), (5, 3), (2, 9)])
def test_one_f_one_b_warmup_count(p: int, m: int) -> None:
    orders = one_f_one_b_compute_order(p, m)
    for r, order in enumerate(orders):
        warmup = min(p - 1 - r, m)
        first_b = next(k for k, a in enumerate(order) if a.kind is ActionType.BACKWARD)
        # Forwards before the first backward: the warm-up, plus the steady state's first forward.
        assert first_b == (warmup + 1 if m > warmup else m), f"rank {r}"
        assert order[:warmup] == [F(r, i) for i in range(warmup)]
        # Forwards and backwards each run in micro-batch order.
        assert [a.microbatch for a in order if a.kind is ActionType.FORWARD] == list(range(m))
        assert [a.microbatch for a in order if a.kind is ActionType.BACKWARD] == list(range(m))


def test_one_f_one_b_fewer_microbatches_than_stages() -> None:
    orders = one_f_one_b_compute_order(4, 2)
    assert orders == [
        [F(0, 0), F(0, 1), B(0, 0), B(0, 1)],  # warm-up min(3, 2) = 2: GPipe-like
        [F(1, 0), F(1, 1), B(1, 0), B(1, 1)],  # warm-up 2
        [F(2, 0), F(2, 1), B(2, 0), B(2, 1)],  # warm-up 1, then F1 B0, then B1
        [F(3, 0), B(3, 0), F(3, 1), B(3, 1)],  # last stage: no warm-up
    ]
    validate_schedule(build_schedule("1f1b", 4, 2))


def test_gpipe_compute_order_backwards_in_reverse() -> None:
    assert gpipe_compute_order(3, 2) == [[F(s, 0), F(s, 1), B(s, 1), B(s, 0)] for s in range(3)]


def test_forward_only_schedule() -> None:
    for kind in KINDS:
        schedule = build_schedule(kind, 3, 2, training=False)
        assert schedule.name == "forward"
        assert not schedule.training
        assert list(schedule.actions[0]) == [F(0, 0), SF(0, 0), F(0, 1), SF(0, 1)]
        assert list(schedule.actions[1]) == [RF(1, 0), F(1, 0), SF(1, 0), RF(1, 1), F(1, 1), SF(1, 1)]
        assert list(schedule.actions[2]) == [RF(2, 0), F(2, 0), RF(2, 1), F(2, 1)]


def test_single_stage_has_no_communication() -> None:
    schedule = build_schedule("1f1b", 1, 3)
    assert list(schedule.actions[0]) == [F(0, 0), B(0, 0), F(0, 1), B(0, 1), F(0, 2), B(0, 2)]


def test_action_str_and_peer_rank() -> None:
    assert str(F(2, 5)) == "F2.5"
    assert str(RB(1, 0)) == "RECV_B1.0"
    assert repr(B(0, 1)) == "Action(B0.1)"
    schedule = build_schedule("gpipe", 3, 1)
    assert schedule.peer_rank(SF(1, 0)) == 2
    assert schedule.peer_rank(RB(1, 0)) == 2
    assert schedule.peer_rank(RF(1, 0)) == 0
    assert schedule.peer_rank(SB(1, 0)) == 0
    with pytest.raises(ValueError, match="computation, it has no peer"):
        schedule.peer_rank(F(1, 0))


# ---------------------------------------------------------------------------------------- validator


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", KINDS)
def test_build_schedule_validates_all_small_sizes(kind: str, training: bool) -> None:
    for p, m in itertools.product(range(1, 6), range(1, 10)):
        schedule = build_schedule(kind, p, m, training=training)
        validate_schedule(schedule)  # build_schedule validates too; this states it explicitly
        assert schedule.num_ranks == p
        per_rank = 2 * m if training else m
        assert [len(compute_only(a)) for a in schedule.actions] == [per_rank] * p


def _gpipe_actions(p: int, m: int) -> list[list[Action]]:
    return [list(a) for a in build_schedule("gpipe", p, m).actions]


def test_validator_missing_backward() -> None:
    actions = _gpipe_actions(2, 3)
    actions[0].remove(B(0, 1))
    with pytest.raises(ScheduleError, match=r"Rank 0 must run B0\.1 exactly once, but it appears 0 times"):
        validate_schedule(make(actions, 3))


def test_validator_backward_before_forward() -> None:
    actions = _gpipe_actions(2, 2)
    # Rank 1: run B1.0 (and its send) before F1.0 and its receive.
    actions[1] = [RF(1, 1), F(1, 1), B(1, 0), SB(1, 0), RF(1, 0), F(1, 0), B(1, 1), SB(1, 1)]
    with pytest.raises(ScheduleError, match=r"Rank 1 runs B1\.0 before F1\.0"):
        validate_schedule(make(actions, 2))


def test_validator_duplicated_forward() -> None:
    actions = _gpipe_actions(2, 2)
    actions[0].insert(1, F(0, 0))
    with pytest.raises(ScheduleError, match=r"Rank 0 must run F0\.0 exactly once, but it appears 2 times"):
        validate_schedule(make(actions, 2))


def test_validator_recv_after_its_forward() -> None:
    actions = _gpipe_actions(2, 2)
    assert actions[1][:2] == [RF(1, 0), F(1, 0)]
    actions[1][:2] = [F(1, 0), RF(1, 0)]
    with pytest.raises(ScheduleError, match=r"Rank 1 must run RECV_F1\.0 before F1\.0"):
        validate_schedule(make(actions, 2))


def test_validator_send_before_its_forward() -> None:
    actions = _gpipe_actions(2, 2)
    assert actions[0][:2] == [F(0, 0), SF(0, 0)]
    actions[0][:2] = [SF(0, 0), F(0, 0)]
    with pytest.raises(ScheduleError, match=r"Rank 0 must run SEND_F0\.0 after F0\.0"):
        validate_schedule(make(actions, 2))


def test_validator_missing_receive() -> None:
    actions = _gpipe_actions(2, 2)
    actions[0].remove(RB(0, 1))
    with pytest.raises(ScheduleError, match=r"Rank 0 must run RECV_B0\.1 exactly once, but it appears 0"):
        validate_schedule(make(actions, 2))


def _misordered_receives() -> PipelineSchedule:
    # Rank 0 sends micro-batch 0 then 1; rank 1 receives 1 then 0. Each rank on its own is legal.
    return make(
        [
            [F(0, 0), SF(0, 0), F(0, 1), SF(0, 1), RB(0, 1), B(0, 1), RB(0, 0), B(0, 0)],
            [RF(1, 1), F(1, 1), RF(1, 0), F(1, 0), B(1, 1), SB(1, 1), B(1, 0), SB(1, 0)],
        ],
        2,
    )


def test_match_messages_rejects_misordered_pairs() -> None:
    with pytest.raises(
        ScheduleError,
        match=(
            r"Messages from pipeline rank 0 to rank 1 do not pair up in order: rank 0 sends "
            r"\[\('F', 0, 0\), \('F', 0, 1\)\] but rank 1 receives \[\('F', 0, 1\), \('F', 0, 0\)\]"
        ),
    ):
        match_messages(_misordered_receives())


def test_validator_rejects_misordered_pairs() -> None:
    with pytest.raises(ScheduleError, match="do not pair up in order"):
        validate_schedule(_misordered_receives())


def test_match_messages_pairs_valid_schedule() -> None:
    schedule = build_schedule("1f1b", 2, 3)
    partners = match_messages(schedule)
    a0, a1 = schedule.actions
    for s0, r1 in [(SF(0, i), RF(1, i)) for i in range(3)] + [(RB(0, i), SB(1, i)) for i in range(3)]:
        assert partners[(0, a0.index(s0))] == (1, a1.index(r1))
        assert partners[(1, a1.index(r1))] == (0, a0.index(s0))
    # Six messages, each recorded from both ends.
    assert len(partners) == 12


def test_validator_deadlock_both_ranks_receive_first() -> None:
    # Rank 0 waits for the gradient before it sends the activation; rank 1 waits for the activation.
    schedule = make(
        [
            [F(0, 0), RB(0, 0), B(0, 0), SF(0, 0)],
            [RF(1, 0), F(1, 0), B(1, 0), SB(1, 0)],
        ],
        1,
        name="stuck",
    )
    with pytest.raises(
        ScheduleError,
        match=r"Schedule 'stuck' deadlocks: rank 0 waits in \[RECV_B0\.0\]; rank 1 waits in \[RECV_F1\.0\]",
    ):
        validate_schedule(schedule)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(schedule)


def test_validator_action_on_wrong_rank() -> None:
    actions = _gpipe_actions(2, 1)
    actions[0].append(F(1, 0))
    with pytest.raises(ScheduleError, match=r"Rank 0 runs F1\.0, but stage 1 lives on rank 1"):
        validate_schedule(make(actions, 1))


def test_validator_action_out_of_range() -> None:
    actions = _gpipe_actions(2, 2)
    actions[0].append(F(0, 2))
    with pytest.raises(ScheduleError, match=r"Rank 0 has F0\.2, outside 2 stages x 2 micro-batches"):
        validate_schedule(make(actions, 2))


def test_validator_extra_compute_action() -> None:
    actions = _gpipe_actions(2, 1)
    actions[1].append(Action(1, ActionType.BACKWARD_WEIGHT, 0))
    with pytest.raises(ScheduleError, match="Rank 1 has 3 compute actions, expected 2"):
        validate_schedule(make(actions, 1))


def test_validator_forward_only_rejects_backward() -> None:
    actions = [list(a) for a in build_schedule("gpipe", 2, 1, training=False).actions]
    actions[1].append(B(1, 0))
    with pytest.raises(ScheduleError, match="Rank 1 has 2 compute actions, expected 1"):
        validate_schedule(make(actions, 1, training=False))


def test_validator_stage_to_rank_checks() -> None:
    actions = tuple(tuple(a) for a in build_schedule("gpipe", 2, 1).actions)
    wrong_length = PipelineSchedule("x", 2, 1, (0, 1, 1), actions)
    with pytest.raises(ScheduleError, match="stage_to_rank has 3 entries for 2 stages"):
        validate_schedule(wrong_length)
    unused_rank = PipelineSchedule("x", 2, 1, (0, 0), actions)
    with pytest.raises(ScheduleError, match=r"must use every rank 0\.\.1"):
        validate_schedule(unused_rank)


def test_validator_send_past_last_stage_is_schedule_error() -> None:
    actions = _gpipe_actions(2, 1)
    actions[1].insert(2, SF(1, 0))  # stage 1 is the last stage: there is no stage 2 to send to
    with pytest.raises(
        ScheduleError,
        match=r"^Rank 1 has SEND_F1\.0, which no computation of its stages needs \(a message past the "
        r"first or last stage",
    ):
        validate_schedule(make(actions, 1))


def test_validator_forward_only_rejects_gradient_messages() -> None:
    actions = [list(a) for a in build_schedule("gpipe", 2, 1, training=False).actions]
    actions[0].append(RB(0, 0))
    actions[1].append(SB(1, 0))
    with pytest.raises(
        ScheduleError,
        match=r"^Rank 0 has RECV_B0\.0, which no computation of its stages needs .*or a gradient in a "
        r"forward-only schedule\)\.$",
    ):
        validate_schedule(make(actions, 1, training=False))


def test_split_backward_schedule_validates_and_simulates() -> None:
    """The zero-bubble IR (BACKWARD_INPUT then BACKWARD_WEIGHT) passes the validator."""
    orders = [
        [F(s, 0), Action(s, ActionType.BACKWARD_INPUT, 0), Action(s, ActionType.BACKWARD_WEIGHT, 0)]
        for s in range(2)
    ]
    actions = lower(orders, (0, 1), ReceiveAt.NEEDED, "the test's")
    assert actions[0] == [F(0, 0), SF(0, 0), RB(0, 0), orders[0][1], orders[0][2]]
    assert actions[1] == [RF(1, 0), F(1, 0), orders[1][1], SB(1, 0), orders[1][2]]
    schedule = make(actions, 1)
    validate_schedule(schedule)
    result = simulate(schedule, forward_time=1, backward_time=2)
    # F0 [0,1], F1 [1,2], I1 [2,3], W1 [3,4]; I0 [3,4], W0 [4,5].
    assert result.makespan == pytest.approx(5.0)
    assert result.peak_inflight == (1, 1)
    # W without I on a rank that splits its backward is caught.
    broken = [list(a) for a in actions]
    broken[1].remove(orders[1][2])
    with pytest.raises(ScheduleError, match=r"Rank 1 must run W1\.0 exactly once"):
        validate_schedule(make(broken, 1))


# ---------------------------------------------------------------------------------------- simulator


@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
@pytest.mark.parametrize("kind", KINDS)
def test_simulated_makespan_and_bubble_equal_stages(kind: str, tf: float, tb: float) -> None:
    for p, m in itertools.product([2, 3, 4, 8], [1, 2, 4, 8, 16, 32]):
        result = simulate(build_schedule(kind, p, m), forward_time=tf, backward_time=tb)
        assert result.makespan == pytest.approx((m + p - 1) * (tf + tb)), (p, m)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m)
        assert result.busy == pytest.approx([m * (tf + tb)] * p), (p, m)


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_single_stage_has_no_bubble(kind: str) -> None:
    result = simulate(build_schedule(kind, 1, 4))
    assert result.makespan == pytest.approx(4 * 3.0)
    assert result.bubble_fraction == pytest.approx(0.0)


def test_peak_inflight_one_f_one_b_vs_gpipe() -> None:
    for p, m in itertools.product([2, 3, 4, 8], [1, 2, 4, 8, 16, 32]):
        ofob = simulate(build_schedule("1f1b", p, m)).peak_inflight
        assert ofob == tuple(min(p - r, m) for r in range(p)), (p, m)
        assert max(ofob) <= p
        assert simulate(build_schedule("gpipe", p, m)).peak_inflight == (m,) * p, (p, m)


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_timeline_respects_dependencies(kind: str) -> None:
    p, m = 4, 6
    tf, tb = [1.0, 2.0, 0.5, 1.5], [2.0, 3.0, 1.0, 4.0]
    result = simulate(build_schedule(kind, p, m), forward_time=tf, backward_time=tb)
    times = {
        (t.action.kind, t.action.stage_index, t.action.microbatch): t
        for t in result.timeline
        if t.action.kind.is_compute
    }
    assert len(times) == 2 * p * m
    fw, bw = ActionType.FORWARD, ActionType.BACKWARD
    for s, i in itertools.product(range(p), range(m)):
        assert times[(fw, s, i)].end - times[(fw, s, i)].start == pytest.approx(tf[s])
        assert times[(bw, s, i)].end - times[(bw, s, i)].start == pytest.approx(tb[s])
        assert times[(bw, s, i)].start >= times[(fw, s, i)].end
        if s > 0:
            assert times[(fw, s, i)].start >= times[(fw, s - 1, i)].end
        if s < p - 1:
            assert times[(bw, s, i)].start >= times[(bw, s + 1, i)].end
    # One rank computes one thing at a time.
    for r in range(p):
        spans = sorted((t.start, t.end) for t in result.timeline if t.rank == r and t.action.kind.is_compute)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in itertools.pairwise(spans))


@pytest.mark.parametrize("kind", KINDS)
def test_simulated_unequal_stages_bounded_by_slowest_stage(kind: str) -> None:
    tf, tb = [1.0, 3.0, 1.0, 0.5], [2.0, 5.0, 1.0, 1.0]
    slowest = max(f + b for f, b in zip(tf, tb, strict=True))
    for m in [1, 2, 4, 8, 16]:
        result = simulate(build_schedule(kind, 4, m), forward_time=tf, backward_time=tb)
        assert result.makespan >= m * slowest - 1e-9
        # ... and at least one micro-batch's trip through every stage.
        assert result.makespan >= sum(tf) + sum(tb) - 1e-9
        assert result.busy == pytest.approx([m * (f + b) for f, b in zip(tf, tb, strict=True)])


def test_simulated_unequal_stages_exact_small_case() -> None:
    # One micro-batch: F0 [0,1], F1 [1,4], B1 [4,8], B0 [8,10].
    result = simulate(build_schedule("gpipe", 2, 1), forward_time=[1, 3], backward_time=[2, 4])
    assert result.makespan == pytest.approx(10.0)
    assert result.busy == pytest.approx([3.0, 7.0])
    assert result.bubble_fraction == pytest.approx(1 - 10 / 20)


def test_simulated_comm_time_adds_to_the_critical_path() -> None:
    # p=2, m=1: forward message and gradient message each cost comm_time on the critical path.
    result = simulate(build_schedule("gpipe", 2, 1), forward_time=1, backward_time=2, comm_time=0.5)
    assert result.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_simulate_per_stage_time_length_checked() -> None:
    with pytest.raises(ValueError, match="forward_time has 3 entries but the schedule has 2 stages"):
        simulate(build_schedule("gpipe", 2, 2), forward_time=[1, 1, 1])
    with pytest.raises(ValueError, match="backward_time has 1 entries but the schedule has 2 stages"):
        simulate(build_schedule("gpipe", 2, 2), backward_time=[1])


# ---------------------------------------------------------------------------------------- render


def test_render_one_f_one_b_p2_m2_exact() -> None:
    assert render_schedule(build_schedule("1f1b", 2, 2)) == (
        "1f1b: 2 stages, 2 micro-batches, bubble 33.3%\nrank 0 | F0 F1 .  B0 .  B1\nrank 1 | .  F0 B0 F1 B1 ."
    )


def test_render_gpipe_p2_m2_exact() -> None:
    assert render_schedule(build_schedule("gpipe", 2, 2)) == (
        "gpipe: 2 stages, 2 micro-batches, bubble 33.3%\n"
        "rank 0 | F0 F1 .  .  B1 B0\n"
        "rank 1 | .  F0 F1 B1 B0 ."
    )


@pytest.mark.parametrize("kind", KINDS)
def test_render_header_and_one_row_per_rank(kind: str) -> None:
    p, m = 4, 8
    text = render_schedule(build_schedule(kind, p, m), backward_time=2)
    header, *rows = text.split("\n")
    bubble = (p - 1) / (m + p - 1)
    assert header == f"{kind}: {p} stages, {m} micro-batches, bubble {bubble:.1%}"
    assert len(rows) == p
    for r, row in enumerate(rows):
        assert row.startswith(f"rank {r} | ")
        cells = row.split(" | ", 1)[1].split()
        # Each forward fills one cell and each backward two (backward_time=2).
        assert sum(c.startswith("F") for c in cells) == m
        assert sum(c.startswith("B") for c in cells) == 2 * m
        assert len(cells) == (m + p - 1) * 3  # makespan in unit cells, idle ones included


# ---------------------------------------------------------------------------------------- parsing


def test_schedule_kind_parse() -> None:
    assert ScheduleKind.parse("gpipe") is ScheduleKind.GPIPE
    assert ScheduleKind.parse("1F1B") is ScheduleKind.ONE_F_ONE_B
    assert ScheduleKind.parse(ScheduleKind.GPIPE) is ScheduleKind.GPIPE
    with pytest.raises(
        ValueError, match=r"Unknown pipeline schedule 'zero_bubble': expected one of 'gpipe', '1f1b'"
    ):
        ScheduleKind.parse("zero_bubble")
    with pytest.raises(ValueError, match="expected one of 'gpipe', '1f1b'"):
        ScheduleKind.parse(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown pipeline schedule 'interleaved'"):
        build_schedule("interleaved", 2, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_build_schedule_rejects_bad_sizes(kind: str) -> None:
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        build_schedule(kind, 2, 0)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        build_schedule(kind, 2, 0, training=False)
    with pytest.raises(ValueError, match=r"num_microbatches must be an integer >= 1, got 2\.5"):
        build_schedule(kind, 2, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1, got 0"):
        build_schedule(kind, 0, 4)


# ----------------------------------------------------------------------------- shared cores
def test_processes_sharing_one_core_slow_only_the_computations_that_overlap() -> None:
    """GPipe over 2 ranks, 2 micro-batches, every forward and backward 1 s, one core for both
    (slots=1). By hand, sharing the core: F0.0 alone (0 - 1); F0.1 on rank 0 and F1.0 on rank 1
    together, each at half speed (1 - 3); F1.1 alone (3 - 4), B1.1 alone (4 - 5); B1.0 and B0.1
    together (5 - 7); B0.0 alone (7 - 8): 8 s, the work on one core, where each rank on a core of
    its own takes 6 s. The fixed point settles within a percent of it; with a core each nothing
    changes; more processes per pipeline rank (tensor or data ranks) slow it in proportion."""
    from lightning_pipe.schedule.shared_cores import simulate_shared

    schedule = build_schedule("gpipe", 2, 2)
    assert simulate(schedule, 1.0, 1.0).makespan == pytest.approx(6.0)
    shared = simulate_shared(schedule, 1.0, 1.0, 0.0, slots=1.0)
    assert shared.makespan == pytest.approx(8.0, rel=0.01)
    spans = {str(t.action): t.end - t.start for t in shared.timeline if t.action.kind.is_compute}
    assert spans["F0.0"] == pytest.approx(1.0) and spans["B0.0"] == pytest.approx(1.0)
    for overlapping in ("F0.1", "F1.0", "B0.1", "B1.0"):
        assert spans[overlapping] == pytest.approx(2.0, rel=0.01), spans
    assert simulate_shared(schedule, 1.0, 1.0, 0.0, slots=2.0) == simulate(schedule, 1.0, 1.0)
    # Two processes per pipeline rank (tp or dp = 2) on 2 slots: the same as one each on one.
    assert simulate_shared(schedule, 1.0, 1.0, 0.0, 2.0, processes_per_rank=2).makespan == pytest.approx(
        shared.makespan
    )
    # 8 per rank on 2 slots: alone 8 processes at a quarter speed (4 s), two together 16 at an
    # eighth (8 s), so 4 + 8 + 4 + 4 + 8 + 4 = 32 s: the 64 process-seconds of work over 2 slots.
    eight = simulate_shared(schedule, 1.0, 1.0, 0.0, 2.0, processes_per_rank=8)
    assert eight.makespan == pytest.approx(32.0, rel=0.01)
    # One pipeline rank of 4 processes on 2 slots: every computation at half speed.
    alone = build_schedule("gpipe", 1, 2)
    assert simulate_shared(alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4).makespan == pytest.approx(
        2 * simulate(alone, 1.0, 2.0).makespan
    )
    with pytest.raises(ValueError, match="slots must be positive"):
        simulate_shared(schedule, 1.0, 1.0, 0.0, slots=0.0)


def test_waits_inside_a_computation_keep_their_time_on_shared_cores() -> None:
    """One pipeline rank of 4 processes on 2 slots, GPipe over 2 micro-batches: every computation
    runs at half speed (forward 1 s, backward 2 s: 2 x (2 + 4) = 12 s, against 6 s alone). Where
    half of each is a wait (a tensor-parallel all-reduce, already timed with every process on the
    cores), only the other half slows: forward 0.5 x 2 + 0.5 = 1.5 s, backward 1 x 2 + 1 = 3 s,
    9 s in all. A wait longer than its computation is refused."""
    from lightning_pipe.schedule.shared_cores import simulate_shared

    alone = build_schedule("gpipe", 1, 2)
    assert simulate_shared(alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4).makespan == pytest.approx(12.0)
    waited = simulate_shared(
        alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4, unpaced_forward=0.5, unpaced_backward=[1.0]
    )
    assert waited.makespan == pytest.approx(9.0)
    spans = sorted(t.end - t.start for t in waited.timeline if t.action.kind.is_compute)
    assert spans == pytest.approx([1.5, 1.5, 3.0, 3.0])
    # All of it a wait: nothing slows.
    assert simulate_shared(
        alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4, unpaced_forward=1.0, unpaced_backward=2.0
    ).makespan == pytest.approx(6.0)
    with pytest.raises(ValueError, match="Stage 0's unpaced seconds"):
        simulate_shared(alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4, unpaced_forward=1.5)
    with pytest.raises(ValueError, match="unpaced_backward has 2 entries but the schedule has 1 stages"):
        simulate_shared(alone, 1.0, 2.0, 0.0, 2.0, processes_per_rank=4, unpaced_backward=[1.0, 1.0])
