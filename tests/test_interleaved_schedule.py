"""Interleaved 1F1B as data: no processes, the builder, validator and simulator.

For p in {2, 3, 4, 8} ranks, v in {2, 3} stages per rank and every m from 1 to 32: the schedule
validates (every action once, legal order, messages that pair up, no deadlock), each rank holds
its loop-placed stages, the simulated bubble with equal stage times equals
(p - 1) / (v m + p - 1) whenever p divides m (Megatron's case) and is never worse than 1F1B's
for the same work, and no rank runs more forwards ahead of its backwards than Megatron's
warm-up plus one.
"""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe.schedule.actions import ActionType, ScheduleError
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.schedule.interleaved import loop_placement
from lightning_pipe.schedule.simulate import simulate

SIZES = list(itertools.product((2, 3, 4, 8), (2, 3)))


def _most_ahead(actions: tuple[object, ...]) -> int:
    ahead = most = 0
    for action in actions:
        kind = getattr(action, "kind", None)
        if kind is ActionType.FORWARD:
            ahead += 1
            most = max(most, ahead)
        elif kind is ActionType.BACKWARD:
            ahead -= 1
    return most


@pytest.mark.parametrize(("p", "v"), SIZES, ids=[f"p{p}-v{v}" for p, v in SIZES])
def test_interleaved_validates_and_reaches_the_bubble_formula(p: int, v: int) -> None:
    for m in range(1, 33):
        schedule = build_schedule("interleaved_1f1b", p * v, m, virtual_stages=v)  # validates
        assert schedule.num_ranks == p and schedule.stage_to_rank == loop_placement(p, v)
        assert all(schedule.stages_of(r) == [r + c * p for c in range(v)] for r in range(p))
        # Equal stages: a rank's v stages together cost what one 1F1B stage costs (F 1, B 2).
        ours = simulate(schedule, 1.0 / v, 2.0 / v)
        one_f_one_b = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
        formula = (p - 1) / (v * m + p - 1)
        if m % p == 0:
            assert ours.bubble_fraction == pytest.approx(formula, abs=1e-12), (p, v, m)
        else:
            assert formula - 1e-12 <= ours.bubble_fraction <= one_f_one_b.bubble_fraction + 1e-12, (p, v, m)
        for r in range(p):
            cap = min(m * v, 2 * (p - r - 1) + (v - 1) * p) + 1
            assert _most_ahead(schedule.actions[r]) <= cap, (p, v, m, r)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (3, 3)])
def test_interleaved_forward_only_validates(p: int, v: int) -> None:
    for m in range(1, 17):
        schedule = build_schedule("interleaved_1f1b", p * v, m, training=False, virtual_stages=v)
        computes = [[a for a in actions if a.kind.is_compute] for actions in schedule.actions]
        assert all(a.kind is ActionType.FORWARD for actions in computes for a in actions)
        assert [len(c) for c in computes] == [m * v] * p


def test_interleaved_p4_v2_m8_rank0_order_is_megatrons() -> None:
    """Megatron's order for p=4, v=2, m=8 on rank 0: forwards of micro-batches 0-3 on stage 0, then
    0-3 on stage 4, then 4-7 on stage 0 (warm-up 2 (p-1) + (v-1) p = 10), then alternating."""
    schedule = build_schedule("interleaved_1f1b", 8, 8, virtual_stages=2)
    computes = [str(a) for a in schedule.actions[0] if a.kind.is_compute]
    warmup = ["F0.0", "F0.1", "F0.2", "F0.3", "F4.0", "F4.1", "F4.2", "F4.3", "F0.4", "F0.5"]
    assert computes[:10] == warmup
    assert computes[10:14] == ["F0.6", "B4.0", "F0.7", "B4.1"]
    assert computes[-4:] == ["B0.4", "B0.5", "B0.6", "B0.7"]


def test_virtual_stages_need_the_interleaved_schedule() -> None:
    with pytest.raises(ValueError, match='virtual_stages=2\\) need schedule="interleaved_1f1b"'):
        build_schedule("1f1b", 8, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages must be an integer >= 1 that divides"):
        build_schedule("interleaved_1f1b", 6, 4, virtual_stages=4)
    with pytest.raises(ValueError, match="at least 2 pipeline ranks"):
        build_schedule("interleaved_1f1b", 2, 4, virtual_stages=2)
    assert issubclass(ScheduleError, ValueError)


def test_schedule_cli_compares_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_pipe.schedule.cli import main

    assert main(["--compare", "--stages", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["gpipe"][1:3] == ["27.3%", "33"] and rows["gpipe"][3:] == ["8"] * 4
    assert rows["1f1b"][1:3] == ["27.3%", "33"] and rows["1f1b"][3:] == ["4", "3", "2", "1"]
    # Interleaved: (p - 1) / (v m + p - 1) = 3 / 19; rank 0 holds (2 (p - 1) + (v - 1) p + 1) / v.
    assert rows["interleaved_1f1b"][2:] == ["15.8%", "28.5", "5.5", "4.5", "3.5", "2.5"]
