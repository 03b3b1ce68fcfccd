"""Skip connections on paper and in one process: the schedule IR's skip actions, the validator's
proof that schedules with skips cannot deadlock, the plan's checks, the scope's refusals, the
wrappers outside a pipeline and the forward contract with skips.

The multi-process equality to one device is in ``tests/test_skip_connections.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe import Pop, Stash, pop, skippable, stash
from lightning_pipe.batches.forward_contract import check_forward
from lightning_pipe.schedule import build_schedule
from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule, ScheduleError
from lightning_pipe.schedule.render import render_schedule
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.validate import validate_schedule
from lightning_pipe.skip import SkipError, skip_scope
from lightning_pipe.skip.plan import SkipLayers, SkipPlan
from lightning_pipe.skip.scope import SkipScope

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "skips" / "models.py"


def load_example() -> object:
    """``examples/skips/models.py`` as a module (it is a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location("skip_models", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["skip_models"] = module
    spec.loader.exec_module(module)
    return module


LAYOUTS = [
    ("gpipe", 2, 1),
    ("gpipe", 4, 1),
    ("1f1b", 3, 1),
    ("1f1b", 4, 1),
    ("1f1b", 8, 1),
    ("zb_h1", 4, 1),
    ("zb_h1", 8, 1),
    ("interleaved_1f1b", 4, 2),
    ("interleaved_1f1b", 6, 3),
]


def _patterns(p: int) -> list[list[tuple[int, int]]]:
    """A U-Net's nested skips, one producer for every later stage (an encoder output), every pair."""
    nested = [(a, p - 1 - a) for a in range(p // 2) if a < p - 1 - a]
    fan_out = [(0, c) for c in range(1, p)]
    every = [(a, c) for a in range(p) for c in range(a + 1, p)]
    return [nested, fan_out, every]


@pytest.mark.parametrize(("kind", "p", "v"), LAYOUTS)
def test_schedules_with_skips_validate_and_carry_one_message_per_route(kind: str, p: int, v: int) -> None:
    for skips, m, training in itertools.product(_patterns(p), (1, 2, 3, 5, 8), (True, False)):
        schedule = build_schedule(kind, p, m, training=training, virtual_stages=v, skips=skips)
        assert schedule.skips == tuple(sorted(skips))
        remote = [(a, c) for a, c in skips if schedule.stage_to_rank[a] != schedule.stage_to_rank[c]]
        kinds = [ActionType.SEND_SKIP, ActionType.RECV_SKIP]
        if training:
            kinds += [ActionType.SEND_SKIP_GRAD, ActionType.RECV_SKIP_GRAD]
        found = [a for actions in schedule.actions for a in actions if a.kind.is_skip]
        assert len(found) == len(remote) * m * len(kinds), (skips, m, training)
        for a, c in remote:
            for i in range(m):
                rank_a, rank_c = schedule.stage_to_rank[a], schedule.stage_to_rank[c]
                assert Action(a, ActionType.SEND_SKIP, i, c) in schedule.actions[rank_a]
                assert Action(c, ActionType.RECV_SKIP, i, a) in schedule.actions[rank_c]
                if training:
                    assert Action(c, ActionType.SEND_SKIP_GRAD, i, a) in schedule.actions[rank_c]
                    assert Action(a, ActionType.RECV_SKIP_GRAD, i, c) in schedule.actions[rank_a]


def test_a_skip_within_one_rank_moves_nothing() -> None:
    # Interleaved, 2 ranks x 2 stages: stages 0 and 2 live on rank 0.
    schedule = build_schedule("interleaved_1f1b", 4, 4, virtual_stages=2, skips=[(0, 2), (1, 3)])
    assert schedule.skips == ((0, 2), (1, 3))
    assert not [a for actions in schedule.actions for a in actions if a.kind.is_skip]


def test_skips_do_not_change_what_is_computed_when() -> None:
    for kind, p in (("gpipe", 4), ("1f1b", 4), ("zb_h1", 4)):
        plain = build_schedule(kind, p, 6)
        skipped = build_schedule(kind, p, 6, skips=[(0, 3), (1, 2)])
        for a, b in zip(plain.actions, skipped.actions, strict=True):
            assert [x for x in a if x.kind.is_compute] == [x for x in b if x.kind.is_compute]
        simulate(skipped)  # no deadlock with F = 1, B = 2 either


def test_a_skip_receive_placed_late_deadlocks_and_the_validator_says_so() -> None:
    """The lowering posts a skip's receive where it is produced: posted where it is needed instead
    (as 1F1B places its activations), the producer's exchange waits under NCCL's rendezvous for a
    consumer that waits, through the stages between, for the producer."""
    good = build_schedule("1f1b", 4, 4, skips=[(0, 3)])
    rank3 = list(good.actions[3])
    late = [a for a in rank3 if a.kind is ActionType.RECV_SKIP]
    for action in late:
        rank3.remove(action)
        needed = rank3.index(Action(3, ActionType.FORWARD, action.microbatch))
        rank3.insert(needed, action)
    bad = dataclasses.replace(good, actions=(*good.actions[:3], tuple(rank3)))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate_schedule(bad)


def test_the_validator_refuses_missing_and_misplaced_skip_actions() -> None:
    good = build_schedule("gpipe", 3, 2, skips=[(0, 2)])
    send = Action(0, ActionType.SEND_SKIP, 1, 2)
    without = tuple(a for a in good.actions[0] if a != send)
    with pytest.raises(ScheduleError, match=r"SEND_S0\.1>2 exactly once"):
        validate_schedule(dataclasses.replace(good, actions=(without, *good.actions[1:])))
    recv = Action(2, ActionType.RECV_SKIP, 0, 0)
    moved = [a for a in good.actions[2] if a != recv] + [recv]
    with pytest.raises(ScheduleError, match=r"must run RECV_S2\.0<0 before F2\.0"):
        validate_schedule(dataclasses.replace(good, actions=(*good.actions[:2], tuple(moved))))
    unlisted = dataclasses.replace(good, skips=())
    with pytest.raises(ScheduleError, match="skip connection the schedule does not list"):
        validate_schedule(unlisted)
    with pytest.raises(ValueError, match="earlier and a later stage"):
        build_schedule("gpipe", 3, 2, skips=[(2, 1)])


def test_skip_actions_print_their_other_end_and_need_one() -> None:
    assert str(Action(0, ActionType.SEND_SKIP, 3, 2)) == "SEND_S0.3>2"
    assert str(Action(2, ActionType.RECV_SKIP_GRAD, 1, 5)) == "RECV_SB2.1<5"
    with pytest.raises(ValueError, match="peer_stage"):
        Action(0, ActionType.SEND_SKIP, 0)
    with pytest.raises(ValueError, match="peer_stage"):
        Action(0, ActionType.SEND_F, 0, 1)
    schedule: PipelineSchedule = build_schedule("1f1b", 3, 2, skips=[(0, 2)])
    assert schedule.peer_rank(Action(0, ActionType.SEND_SKIP, 0, 2)) == 2
    assert "skips 0->2" in render_schedule(schedule)


# ----------------------------------------------------------------------------- plan and scope


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x + sum(extra, torch.zeros_like(x))))


def test_the_plan_routes_each_name_once_per_stage_pair() -> None:
    blocks = [Block() for _ in range(6)]
    layers = [
        Stash("a", blocks[0]),
        Stash("b", blocks[1]),
        Pop("b", blocks[2]),
        Pop(["a", "b"], blocks[3]),
        blocks[4],
        Pop("a", blocks[5]),
    ]
    inner, skips = SkipLayers.of(layers)
    assert inner == blocks
    stage = [0, 0, 1, 1, 2, 2]
    routes = skips.plan.routes(lambda k: stage[k])
    assert [(r.producer, r.consumer, r.names) for r in routes] == [(0, 1, ("a", "b")), (0, 2, ("a",))]
    # All on one stage: nothing travels.
    assert skips.plan.routes(lambda k: 0) == ()
    assert skips.plan.declared_by(range(2, 4)).pop == ("b", "a")


def test_the_plan_refuses_what_cannot_be_routed() -> None:
    blocks = [Block() for _ in range(3)]
    with pytest.raises(ValueError, match=r"stashed by pipeline layer 0 .* and by pipeline layer 1"):
        SkipPlan.of_layers([Stash("a", blocks[0]), Stash("a", blocks[1]), Pop("a", blocks[2])])
    with pytest.raises(ValueError, match="pops skip 'a' before pipeline layer 2"):
        SkipPlan.of_layers([blocks[0], Pop("a", blocks[1]), Stash("a", blocks[2])])
    with pytest.raises(ValueError, match="pops skip 'x', which no pipeline layer stashes"):
        SkipPlan.of_layers([blocks[0], Pop("x", blocks[1])])


def test_the_stage_scope_refuses_undeclared_skips() -> None:
    scope = SkipScope({"a": torch.ones(1)}, may_stash=["s"], may_pop=["a", "s"], where="pipeline stage 1")
    with scope.active():
        stash("s", torch.zeros(1))
        assert pop("s").item() == 0.0 and pop("a").item() == 1.0
        with pytest.raises(SkipError, match="stashed 'other', which none of its layers declares"):
            stash("other", torch.zeros(1))
        with pytest.raises(SkipError, match="popped 'b', which none of its layers declares"):
            pop("b")
        with pytest.raises(SkipError, match="stashed twice"):
            stash("s", torch.zeros(1))


def test_wrappers_and_skippable_modules_run_outside_a_pipeline() -> None:
    @skippable(stash=["h"])
    class Stasher(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stash("h", x * 2)
            return x + 1

    blocks = [Block(), Block()]
    chain = nn.Sequential(Stasher(), Stash("a", blocks[0]), Pop(["a", "h"], blocks[1]))
    x = torch.randn(3, 4)
    with skip_scope():
        got = chain(x)
    h = blocks[0](x + 1)
    torch.testing.assert_close(got, blocks[1](h, h, x * 2), rtol=0, atol=0)
    torch.testing.assert_close(chain(x), got, rtol=0, atol=0)  # this thread's scope, no skip_scope()
    instance = skippable(Block(), pop="z")
    assert SkipPlan.of_layers([Stash("z", Block()), instance]).declared_by([1]).pop == ("z",)
    with pytest.raises(SkipError, match="nothing was stashed under that name"):
        with skip_scope():
            Pop("never", Block())(x)


def test_the_forward_contract_checks_a_unet_forward_against_its_skips() -> None:
    models = load_example()
    unet = models.UNet()  # type: ignore[attr-defined]
    probe = torch.randn(2, 1, 16, 16)
    _, skips = SkipLayers.of(unet.configure_pipeline())
    assert check_forward(unet.forward, unet.configure_pipeline(), unet, probe) == (None, None)

    class Crossed(type(unet)):  # type: ignore[misc]
        """Hands the up blocks each other's skips: a forward that is not the pipeline."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x1 = self.inc(x)
            x2 = self.down1(x1)
            x3 = self.down2(x2)
            y = self.up1(self.down3(x3), x3)
            y = self.up2(y, x2)
            return self.outc(self.up3(y, x1 * 0.5))

    crossed = Crossed()
    error, _ = check_forward(crossed.forward, crossed.configure_pipeline(), crossed, probe)
    assert error is not None and "differs from the chained layers" in error
    assert not skips.plan.empty
