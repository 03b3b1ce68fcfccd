"""A layer that changes the stage's input in place (``nn.ReLU(inplace=True)`` first in a stage).

A stage's input arrives as a leaf that requires grad, which autograd refuses to change in place;
one device hands that layer the previous layer's output. Without the copy (checked by removing it)
the pp=2 runs below failed on the second stage: "a leaf Variable that requires grad is being used
in an in-place operation", and the first stage's rank reported that its peer had stopped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.layers import InPlaceInputError, apply_layers
from tests.distributed import run_distributed

TOL = 1e-5
ROWS, MICRO = 8, 2


class AddOne(nn.Module):
    """Changes its input in place without saying so (no ``inplace`` attribute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def test_a_known_in_place_layer_gets_a_copy_of_a_leaf_input() -> None:
    for first in (nn.ReLU(inplace=True), nn.Sequential(nn.Dropout(0.0, inplace=True), nn.ReLU())):
        leaf = torch.randn(4, 3) - 0.5
        leaf.requires_grad_(True)
        leaf.marker = "kept"  # type: ignore[attr-defined]
        before = leaf.detach().clone()
        seen: list[str] = []
        first.register_forward_pre_hook(lambda _, args, record=seen.append: record(args[0].marker))
        out = apply_layers([first], leaf, stage_index=1)
        assert seen == ["kept"]  # the copy carries the tensor's attributes
        assert torch.equal(leaf.detach(), before)  # the stage input itself is not changed
        torch.testing.assert_close(out.detach(), before.clamp(min=0))
        out.sum().backward()
        torch.testing.assert_close(leaf.grad, (before > 0).float())


def test_gradients_through_the_copy_equal_one_device() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    leaf = x.clone().requires_grad_(True)
    apply_layers([nn.ReLU(inplace=True), linear], leaf).pow(2).sum().backward()
    grad_w = linear.weight.grad.clone()
    linear.weight.grad = None
    computed = x.clone().requires_grad_(True)
    one_device = computed * 1.0  # one device: the previous layer's output, no leaf
    linear(nn.ReLU(inplace=True)(one_device)).pow(2).sum().backward()
    torch.testing.assert_close(linear.weight.grad, grad_w)
    torch.testing.assert_close(computed.grad, leaf.grad)


def test_an_unknown_in_place_layer_stops_with_the_fix() -> None:
    leaf = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(
        InPlaceInputError, match=r"Layer 1 \(AddOne\) of pipeline stage 2 changed its input in place"
    ) as e:
        apply_layers([nn.Identity(), AddOne()], leaf, stage_index=2)
    assert "`inplace = True`" in str(e.value) and "partition=[...]" in str(e.value)
    with torch.no_grad():  # evaluation: no gradient, nothing refused, nothing copied
        assert apply_layers([nn.ReLU(inplace=True)], leaf) is leaf


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data()
    losses = [_loss(model(x[i : i + MICRO]), y[i : i + MICRO]) for i in range(0, ROWS, MICRO)]
    torch.stack(losses).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def worker(schedule: str, recompute: str) -> dict[str, torch.Tensor]:
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    model = _model()
    mesh = init_mesh(ParallelLayout(1, 2, 1), "cpu")
    options = RuntimeOptions(
        num_microbatches=ROWS // MICRO, schedule=schedule, recompute=recompute, partition=[3, 2]
    )  # stage 1 starts with nn.ReLU(inplace=True)
    runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options, seed=0)
    runtime.begin_accumulation()
    runtime.train_batch(_data(), lambda out, mb: _loss(out, mb.data[1]))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    runtime.close()
    assert dist.get_world_size() == 2
    return grads


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("schedule", "recompute"), [("1f1b", "never"), ("zb_h1", "never"), ("1f1b", "always")]
)
def test_a_stage_starting_with_an_in_place_activation_trains_like_one_device(
    schedule: str, recompute: str
) -> None:
    reference = _reference()
    grads: dict[str, Any] = {}
    for got in run_distributed(worker, 2, schedule, recompute, timeout=120):
        grads.update(got)
    assert grads.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=TOL, msg=name)
