"""Views that FSDP2 units return (``shard_parameters=True``): an in-place change after one (a
layer without parameters such as ``ReLU(inplace=True)``, or the loss) drops the hook FSDP2
registered on the view to gather the unit's parameters again for its backward. ``pipe_tp`` copies
such views before FSDP2 hooks them, so these models train to one process's gradients and torch's
"returned a view tensor" warning is not printed.

The models' ``Linear`` layers have biases over 3-d inputs, so each returns a view. Without the
copy (checked by removing it), an in-place layer after every unit, or a loss changing the last
stage's output in place, failed the backward under ``reshard_after_forward=True`` ("setStorage:
... out of bounds for storage of size 0", deep in autograd), in one stage at dp=2 and at pp=2 x
dp=2; with ``False`` the parameters stay gathered through the step and the gradients were one
process's, with the warning printed.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-5
ROWS, MICRO = 8, 2


class Double(nn.Module):
    """No parameters (so no FSDP unit), and changes its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


def _model(inplace: bool) -> nn.Sequential:
    torch.manual_seed(0)
    if not inplace:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    # An in-place layer after every unit: after a stage's last unit too, and two pairs in a row.
    return nn.Sequential(nn.Linear(8, 16), Double(), nn.Linear(16, 16), Double(), nn.Linear(16, 4), Double())


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 5, 8, generator=g), torch.randn(ROWS, 5, 4, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        out.mul_(3.0)
    else:
        out = out * 3.0
    return ((out - target) ** 2).mean()


def _reference(inplace: bool) -> dict[str, torch.Tensor]:
    """One process, the same micro-batches: the mean of their losses."""
    model = _model(inplace)
    x, y = _data()
    losses = [_loss(model(x[i : i + MICRO]), y[i : i + MICRO], inplace) for i in range(0, ROWS, MICRO)]
    torch.stack(losses).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worker(pp: int, reshard: bool, inplace: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    model = _model(inplace)
    dp = dist.get_world_size() // pp
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # shown once per place, as outside pytest
        mesh = init_mesh(ParallelLayout(dp, pp, 1), "cpu")
        dp_rank = mesh.layout.coordinates(dist.get_rank()).dp_rank
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        options = RuntimeOptions(
            shard_parameters=True,
            reshard_after_forward=reshard,
            num_microbatches=ROWS // dp // MICRO,
            partition=[4, 2] if pp == 2 else "parameters",  # stage 0 ends with a unit and its Double
        )
        runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options, seed=0)
        runtime.begin_accumulation()
        runtime.train_batch((x[rows], y[rows]), lambda out, mb: _loss(out, mb.data[1], inplace))
    views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None:
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    runtime.close()
    return {"views": views, "grads": grads}


def _check(results: list[dict[str, Any]], reference: dict[str, torch.Tensor]) -> None:
    grads: dict[str, torch.Tensor] = {}
    for got in results:
        assert got["views"] == []
        grads.update(got["grads"])  # each pipeline rank has its stage's
    assert grads.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, atol=TOL, rtol=TOL, msg=name)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("inplace", [True, False])
def test_views_returned_by_fully_sharded_units_train_like_one_device_without_the_warning(
    reshard: bool, inplace: bool
) -> None:
    _check(run_distributed(worker, 2, 1, reshard, inplace, timeout=120), _reference(inplace))


def test_in_place_changes_after_units_across_a_pipeline_train_like_one_device() -> None:
    _check(run_distributed(worker, 4, 2, True, True, timeout=180), _reference(True))


def test_only_views_needing_a_gradient_are_copied_through_containers() -> None:
    from collections import namedtuple

    from lightning_pipe.data_parallel.returned_views import without_views

    leaf = torch.randn(2, 6, requires_grad=True)
    base = leaf * 1.0
    view, plain, frozen = base.view(3, 4), base * 2.0, torch.randn(3).view(3)
    view.marker = "group"  # type: ignore[attr-defined]  # e.g. vocab-parallel logits' group
    Pair = namedtuple("Pair", "a b")
    out = without_views((view, [plain, {"v": view}], Pair(view, frozen), 7))
    copies = [out[0], out[1][1]["v"], out[2].a]
    for copy in copies:
        assert copy._base is None and copy.requires_grad and torch.equal(copy, view)
        assert copy.data_ptr() != view.data_ptr() and copy.marker == "group"  # type: ignore[attr-defined]
    assert out[1][0] is plain and out[2].b is frozen and out[3] == 7  # no view, or no gradient
    assert isinstance(out[2], Pair)
    copies[0].mul_(2.0).sum().backward()  # a copy may change in place; the gradient goes through
    torch.testing.assert_close(leaf.grad, torch.full((2, 6), 2.0))
