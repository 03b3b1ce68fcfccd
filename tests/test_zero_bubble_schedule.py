"""Zero-bubble ZB-H1 as data, and the input/weight split of backward, in one
process: the builder, validator and simulator for p in {2, 3, 4, 8} and m in 1..32, and
:func:`backward_input` against an ordinary backward on modules that stress the split (a weight
used twice, a multi-output node, a stage without an input gradient, normalisation layers).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.execution.split_backward import backward_input
from lightning_pipe.schedule.actions import ActionType
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.schedule.simulate import simulate
from lightning_pipe.schedule.zero_bubble import zero_bubble_compute_order

# ---------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zero_bubble_validates_and_reaches_the_bubble_formula(p: int) -> None:
    for m in range(1, 33):
        schedule = build_schedule("zb_h1", p, m)  # validates: order, pairing, no deadlock
        assert schedule.splits_backward and schedule.stage_to_rank == tuple(range(p))
        # Equal stages, F = I = W = 1 (a backward of 2, split in halves).
        ours = simulate(schedule, 1.0, 2.0)
        one_f_one_b = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
        # Bubble (p - 1)(T_F + T_I - T_W) = p - 1 once m >= p; below, the last micro-batch's
        # critical path: the last stage's m F-I pairs after p - 1 forwards, p - 1 Is back, one W.
        assert ours.makespan == pytest.approx(max(3 * m + p - 1, 2 * (m + p - 1) + 1)), (p, m)
        if m >= p:
            assert ours.makespan - 3 * m == pytest.approx(p - 1)
            assert ours.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert ours.bubble_fraction <= one_f_one_b.bubble_fraction + 1e-12, (p, m)
        if p > 1 and m > 1:
            assert ours.makespan < one_f_one_b.makespan
        # Activations: never more micro-batches alive on any stage than 1F1B's peak (its first stage's).
        assert max(ours.peak_inflight) <= max(one_f_one_b.peak_inflight), (p, m)
        assert ours.peak_inflight == tuple(min(p, m) for _ in range(p)), (p, m)


def test_zero_bubble_p2_m3_compute_order() -> None:
    orders = [" ".join(str(a) for a in order) for order in zero_bubble_compute_order(2, 3)]
    assert orders == [
        "F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2",
        "F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2",
    ]


def test_zero_bubble_actions_interleave_exchanges_in_ticks() -> None:
    schedule = build_schedule("zb_h1", 2, 2)
    assert [str(a) for a in schedule.actions[0]] == [
        "F0.0", "SEND_F0.0", "F0.1", "SEND_F0.1", "RECV_B0.0", "I0.0", "W0.0", "RECV_B0.1", "I0.1", "W0.1",
    ]  # fmt: skip
    assert [str(a) for a in schedule.actions[1]] == [
        "RECV_F1.0", "F1.0", "RECV_F1.1", "I1.0", "SEND_B1.0", "F1.1", "I1.1", "SEND_B1.1", "W1.0", "W1.1",
    ]  # fmt: skip


@pytest.mark.parametrize("p", [2, 4])
def test_zero_bubble_unequal_stages_respect_dependencies(p: int) -> None:
    tf, tb = [1.0, 2.0, 0.5, 1.5][:p], [2.0, 3.0, 1.0, 4.0][:p]
    result = simulate(build_schedule("zb_h1", p, 6), forward_time=tf, backward_time=tb)
    at = {(t.action.kind, t.action.stage_index, t.action.microbatch): t for t in result.timeline}
    f, i_, w = ActionType.FORWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
    for s, k in itertools.product(range(p), range(6)):
        assert at[(i_, s, k)].start >= at[(f, s, k)].end
        assert at[(w, s, k)].start >= at[(i_, s, k)].end
        if s < p - 1:
            assert at[(i_, s, k)].start >= at[(i_, s + 1, k)].end
    assert result.busy == pytest.approx([6 * (a + b) for a, b in zip(tf, tb, strict=True)])


def test_zero_bubble_forward_only_validates() -> None:
    for p, m in itertools.product([2, 4], [1, 5, 8]):
        schedule = build_schedule("zb_h1", p, m, training=False)
        assert not schedule.splits_backward
        assert all(a.kind in (ActionType.FORWARD, ActionType.SEND_F, ActionType.RECV_F)
                   for actions in schedule.actions for a in actions)  # fmt: skip


def test_zero_bubble_rejects_virtual_stages() -> None:
    with pytest.raises(ValueError, match=r'virtual_stages=2\) need schedule="interleaved_1f1b"'):
        build_schedule("zb_h1", 4, 4, virtual_stages=2)


# ---------------------------------------------------------------------------------- split backward


class _Reused(nn.Module):
    """One Linear applied twice: its weight hangs off two nodes of the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(torch.relu(self.linear(x))))


class _Gated(nn.Module):
    """A chunked output (one node, two outputs) and a weight added to the output directly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.shift = nn.Linear(6, 12), nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.linear(x).chunk(2, dim=-1)
        return a * torch.sigmoid(b) + self.shift


def _modules() -> list[tuple[str, nn.Module, torch.Tensor, int]]:
    torch.manual_seed(0)
    transformer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    conv = nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.ReLU())
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    return [
        ("mlp", mlp, torch.randn(4, 6), 4),
        ("mlp-3d", copy.deepcopy(mlp), torch.randn(3, 4, 6), 4),
        ("reused-weight", _Reused(), torch.randn(4, 6), 2),  # the Linear's weight and bias: in I
        ("multi-output", _Gated(), torch.randn(4, 6), 3),
        ("embedding", nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6)), torch.randint(0, 10, (4, 3)), 3),
        ("transformer", transformer, torch.randn(2, 5, 8), 12),
        ("conv-batchnorm", conv, torch.randn(2, 3, 9), 4),
    ]  # fmt: skip


@pytest.mark.parametrize(("name", "module", "x", "deferred"), _modules(), ids=[c[0] for c in _modules()])
def test_backward_input_then_weights_equals_one_backward(
    name: str, module: nn.Module, x: torch.Tensor, deferred: int
) -> None:
    reference = copy.deepcopy(module)
    grad_in = x.is_floating_point()
    x_ref = x.clone().requires_grad_(grad_in)
    out = reference(x_ref)
    g = torch.randn_like(out)
    out.backward(g)

    hooked: list[str] = []
    for pname, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, pname=pname: hooked.append(pname))
    x_ours = x.clone().requires_grad_(grad_in)
    work = backward_input([module(x_ours)], [g], [x_ours] if grad_in else [])
    if grad_in:
        torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-6, rtol=0)
    # The I pass leaves every weight that only one node of the input path reaches for later.
    assert sum(p.grad is None for p in module.parameters()) == deferred
    work.run()
    for (pname, ours), theirs in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=0, msg=pname)
    # Gradients land through autograd's accumulation: each parameter's hook ran exactly once.
    assert sorted(hooked) == sorted(n for n, _ in module.named_parameters())


def test_backward_input_refuses_intermediate_inputs() -> None:
    """autograd's backward runs the node that made an intermediate ``inputs`` tensor (it would
    recompute a checkpointed stage), so only leaves are accepted."""
    x = torch.randn(3, 4, requires_grad=True)
    mid = nn.Linear(4, 4)(x)
    with pytest.raises(ValueError, match="every input must be a leaf tensor"):
        backward_input([mid.sum()], None, [mid])


class _Doubled(nn.Module):
    """A tensor hook on an owner's output: it must apply once, as in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 2)
        return self.b(torch.tanh(h))


class _Scale(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _Scale.calls += 1
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class _Custom(nn.Module):
    """A custom Function that takes the input and a weight: its backward must run once."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_Scale.apply(x, self.w))


class _Reentrant(nn.Module):
    """torch's reentrant checkpoint inside the stage: it refuses backward(inputs=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("module_type", [_Doubled, _Custom, _Reentrant])
def test_backward_input_special_nodes_equal_one_backward(module_type: type[nn.Module]) -> None:
    torch.manual_seed(0)
    module = module_type()
    reference = copy.deepcopy(module)
    x = torch.randn(4, 6)
    x_ref = x.clone().requires_grad_(True)
    out = reference(x_ref)
    g = torch.randn_like(out)
    _Scale.calls = 0
    out.backward(g)
    assert _Scale.calls == (1 if module_type is _Custom else 0)
    x_ours = x.clone().requires_grad_(True)
    work = backward_input([module(x_ours)], [g], [x_ours])
    work.run()
    assert _Scale.calls == (2 if module_type is _Custom else 0)  # once each: reference, ours
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-6, rtol=0)
    for (name, ours), theirs in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=0, msg=name)


def test_replayed_last_stage_accumulates_each_weight_once_in_the_last_weight_pass() -> None:
    """With recomputation the last stage's loss and its replayed layers are two graphs; a weight
    used by both (an L2 penalty in the loss) must reach the reducer's hook once in the armed W."""
    from lightning_pipe.execution.executor import PipelineExecutor

    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)]
    penalised = layers[2].weight
    xs, ys = torch.randn(3, 4, 6).unbind(0), torch.randn(3, 4, 2).unbind(0)

    def head(out: torch.Tensor, i: int) -> torch.Tensor:
        return nn.functional.mse_loss(out, ys[i]) + 1e-2 * penalised.pow(2).sum()

    armed, fires = [False], {id(p): 0 for layer in layers for p in layer.parameters()}
    for layer in layers:
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda q: fires.__setitem__(id(q), fires[id(q)] + armed[0]))
    executor = PipelineExecutor({0: layers}, 1, [0], torch.device("cpu"), recompute="always")
    arm = lambda: armed.__setitem__(0, True)  # noqa: E731
    executor.run(build_schedule("zb_h1", 1, 3), 0, inputs=list(xs), head=head, before_last_backward=arm)
    assert set(fires.values()) == {1}, fires
    reference = copy.deepcopy(nn.Sequential(*layers))
    reference.zero_grad()
    loss = sum(
        nn.functional.mse_loss(reference(x), y) + 1e-2 * reference[2].weight.pow(2).sum()
        for x, y in zip(xs, ys, strict=True)
    )
    (loss / 3).backward()  # type: ignore[operator]
    for ours, theirs in zip(
        (p for layer in layers for p in layer.parameters()), reference.parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=0)
