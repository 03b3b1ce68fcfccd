"""The W pass's weight-gradient rules (:mod:`lightning_pipe.execution.weight_rules`), in one process:
for each rule, a split backward gives bitwise the gradients of one ordinary backward and the rule
(not the per-owner fallback) computed them; the same on transformer stacks in float32 and under
bfloat16 autocast, with the whole W pass in one autograd call; owners a rule must not handle
(saved-tensor hooks, a non-reentrant checkpoint, an op without a rule) fall back and stay exact.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.execution import split_backward
from lightning_pipe.execution.split_backward import WeightGradients, backward_input
from lightning_pipe.execution.weight_rules import has_rule, weight_side


class _Fn(nn.Module):
    """``fn(x, *parameters)`` as a module, for one op with weights."""

    def __init__(self, fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> None:
        super().__init__()
        self.fn = fn
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fn(torch.tanh(x), *self.weights))


def _cases() -> list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str]]:
    return [
        ("linear-2d", lambda: nn.Linear(6, 5), (4, 6), "AddmmBackward0"),
        ("linear-3d", lambda: nn.Linear(6, 5), (3, 4, 6), "AddmmBackward0"),
        ("linear-no-bias", lambda: nn.Linear(6, 5, bias=False), (4, 6), "MmBackward0"),
        ("x@w", lambda: _Fn(lambda x, w: x @ w, (6, 5)), (4, 6), "MmBackward0"),
        ("w@x", lambda: _Fn(lambda x, w: w @ x, (5, 4)), (4, 6), "MmBackward0"),
        ("addmm-alpha-beta",
         lambda: _Fn(lambda x, b, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0), (5,), (6, 5)),
         (4, 6), "AddmmBackward0"),
        ("bmm", lambda: _Fn(lambda x, w: torch.bmm(x, w), (3, 6, 5)), (3, 4, 6), "BmmBackward0"),
        ("layer-norm", lambda: nn.LayerNorm(6), (3, 4, 6), "NativeLayerNormBackward0"),
        ("layer-norm-no-bias", lambda: nn.LayerNorm(6, bias=False), (3, 4, 6), "NativeLayerNormBackward0"),
        ("conv1d", lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 9), "ConvolutionBackward0"),
        ("conv2d-strided-groups", lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), (2, 4, 9, 9),
         "ConvolutionBackward0"),
        ("add-broadcast", lambda: _Fn(lambda x, b: x + b, (6,)), (3, 4, 6), "AddBackward0"),
        ("add-alpha", lambda: _Fn(lambda x, b: torch.add(x, b, alpha=3.0), (4, 6)), (3, 4, 6),
         "AddBackward0"),
        ("mul-scale", lambda: _Fn(lambda x, s: x * s, (6,)), (3, 4, 6), "MulBackward0"),
        ("mul-promoted", lambda: _Fn(lambda x, s: x.to(torch.bfloat16) * s, (6,)), (3, 4, 6), "MulBackward0"),
    ]  # fmt: skip


def _split(module: nn.Module, x: torch.Tensor, g: torch.Tensor, context: Any = None) -> WeightGradients:
    with context if context is not None else torch.enable_grad():
        out = module(x)
    return backward_input([out], [g.to(out.dtype)], [x])


def _reference(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor, context: Any = None
) -> list[torch.Tensor]:
    with context if context is not None else torch.enable_grad():
        out = module(x)
    out.backward(g.to(out.dtype))
    return [p.grad for p in module.parameters()] + [x.grad]  # type: ignore[misc]


def _assert_bitwise(ours: list[torch.Tensor | None], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a is not None, k
        assert a.dtype == b.dtype and torch.equal(a, b), (k, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize(("name", "make", "shape", "node"), _cases(), ids=[c[0] for c in _cases()])
def test_each_rule_is_bitwise_one_backward(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], node: str
) -> None:
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    x0 = torch.randn(*shape)
    g = torch.randn_like(module(x0))
    theirs = _reference(reference, x0.clone().requires_grad_(True), g)

    x = x0.clone().requires_grad_(True)
    work = _split(module, x, g)
    assert [type(o.node).__name__ for o in work.owners] == [node]
    owner = work.owners[0]
    assert has_rule(owner.node)
    assert owner.recorded is not None
    assert weight_side(owner.node, owner.recorded, owner.edges) is not None  # the rule, not the fallback
    work.run()
    _assert_bitwise([p.grad for p in module.parameters()] + [x.grad], theirs)


def _stack(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ]
    )


def _count_engine_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls into autograd's engine, through ``torch.autograd.backward`` or directly."""
    calls = [0]
    original = torch.autograd.graph._engine_run_backward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counting)
    monkeypatch.setattr(torch.autograd, "_engine_run_backward", counting)
    return calls


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("layers", [1, 3])
def test_transformer_stack_is_bitwise_one_backward_in_one_call(
    layers: int, autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _stack(layers, 16)
    reference = copy.deepcopy(module)
    x0, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else (lambda: None)
    theirs = _reference(reference, x0.clone().requires_grad_(True), g, context())

    fired: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    x = x0.clone().requires_grad_(True)
    work = _split(module, x, g, context())
    assert len(work.owners) == 7 * layers and all(has_rule(o.node) for o in work.owners)
    calls = _count_engine_calls(monkeypatch)
    work.run()
    assert calls[0] == 1  # every owner's weights in one autograd call
    _assert_bitwise([p.grad for p in module.parameters()] + [x.grad], theirs)
    # Gradients land through AccumulateGrad: the reducer's hooks fire once per parameter.
    assert sorted(fired) == sorted(n for n, _ in module.named_parameters())


class _Checkpointed(nn.Module):
    """A Linear inside torch's non-reentrant checkpoint: its saved tensors sit behind the
    checkpoint's unpack hook, which would recompute the region on every read."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False))


class _Addcmul(nn.Module):
    """An owner without a rule (``AddcmulBackward0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.out = nn.Parameter(torch.randn(6)), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.addcmul(x, x, self.w))


class _Offloaded(nn.Module):
    """Saved-tensor hooks around the whole stage (as offloading would install)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            return self.b(self.a(x))


@pytest.mark.parametrize("module_type", [_Checkpointed, _Addcmul, _Offloaded])
def test_owners_a_rule_must_not_handle_fall_back_and_stay_exact(module_type: type[nn.Module]) -> None:
    torch.manual_seed(0)
    module = module_type()
    reference = copy.deepcopy(module)
    x0, g = torch.randn(4, 6), torch.randn(4, 6)
    theirs = _reference(reference, x0.clone().requires_grad_(True), g)
    x = x0.clone().requires_grad_(True)
    work = _split(module, x, g)
    declined = [o for o in work.owners if weight_side(o.node, o.recorded or (), o.edges) is None]
    assert declined, [type(o.node).__name__ for o in work.owners]
    if module_type is _Offloaded:
        assert len(declined) == len(work.owners)
    work.run()
    _assert_bitwise([p.grad for p in module.parameters()] + [x.grad], theirs)


def test_a_custom_function_named_like_an_op_gets_no_rule() -> None:
    """Rules are keyed by torch's node classes, not their names."""

    class Addmm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    node = Addmm.apply(torch.randn(2, requires_grad=True)).grad_fn
    assert type(node).__name__ == "AddmmBackward" and not has_rule(node)


def test_walk_marks_the_input_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The analysis is one walk: each node's ``next_functions`` is read a bounded number of times,
    not once per owner above it (the old per-owner walks were quadratic in depth)."""
    module = _stack(4, 8)
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = module(x)
    root = out.grad_fn
    assert root is not None
    graph = split_backward._walk([root], {torch.autograd.graph.get_gradient_edge(x).node})
    assert len(set(graph.order)) == len(graph.order)  # every node once
    assert graph.path[-1] is root and not graph.reentrant
    position = {node: k for k, node in enumerate(graph.order)}
    for node in graph.order:  # post-order: children first
        for child, _ in node.next_functions:
            if child is not None:
                assert position[child] < position[node]
