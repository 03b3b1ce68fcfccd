"""Views that FSDP2 units return (``shard_parameters=True``): torch warns on every run that an
in-place change to one could break the backward; ``pipe_tp`` checks the loss head's case and
silences the warning for its stage roots.

Two processes at dp=2 train a model whose layers return views (a ``Linear`` with a bias over 3-d
inputs) with both ``reshard_after_forward`` settings: no such warning for a stage root, and
every gradient equals one process's. A loss that changes the last stage's output in place trains
to one process's gradients without resharding (the stage's parameters stay gathered), and with
resharding stops with :class:`ChangedOutputError` naming the fix (torch's own failure there is
"setStorage: ... out of bounds for storage of size 0", deep in autograd). A layer without
parameters that changes the previous unit's output in place (``ReLU(inplace=True)``) between two
units gives one process's gradients in both settings. The warning stays for the layers' own
units (an in-place layer after a stage's last unit has no later unit to gather that one again).
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


class Double(nn.Module):
    """No parameters (so no FSDP unit), and changes its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


def _model(inplace_layer: bool) -> nn.Sequential:
    torch.manual_seed(0)
    middle: nn.Module = Double() if inplace_layer else nn.Tanh()
    return nn.Sequential(nn.Linear(8, 16), middle, nn.Linear(16, 16), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 4, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace:
        out.mul_(3.0)
    else:
        out = out * 3.0
    return ((out - target) ** 2).mean()


def _reference(inplace_layer: bool) -> dict[str, torch.Tensor]:
    model = _model(inplace_layer)
    x, y = _data()
    _loss(model(x), y, False).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worker(reshard: bool, inplace_loss: bool, inplace_layer: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_pipe.data_parallel.returned_views import ChangedOutputError
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    model = _model(inplace_layer)
    rank = dist.get_rank()
    x, y = _data()
    mine = (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # shown once per place, as outside pytest
        mesh = init_mesh(ParallelLayout(2, 1, 1), "cpu")
        options = RuntimeOptions(shard_parameters=True, reshard_after_forward=reshard)
        runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options, seed=0)
        error = None
        runtime.begin_accumulation()
        try:
            runtime.train_batch(mine, lambda out, mb: _loss(out, mb.data[1], inplace_loss))
        except ChangedOutputError as e:
            error = str(e)
    views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    roots = [v for v in views if "(FSDPStageRoot)" in v]
    grads = {}
    if error is None:
        for name, param in model.named_parameters():
            grad = param.grad
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    runtime.close()
    return {"views": views, "roots": roots, "error": error, "grads": grads}


@pytest.mark.parametrize("reshard", [True, False])
def test_views_returned_by_fully_sharded_layers_train_like_one_device_without_the_warning(
    reshard: bool,
) -> None:
    for inplace_layer in (False, True):
        reference = _reference(inplace_layer)
        for got in run_distributed(worker, 2, reshard, False, inplace_layer, timeout=120):
            assert got["error"] is None
            assert got["roots"] == []
            assert any("(FSDPLinear)" in v for v in got["views"])  # the layers' units still warn
            assert got["grads"].keys() == reference.keys()
            for name, grad in reference.items():
                torch.testing.assert_close(got["grads"][name], grad, atol=TOL, rtol=TOL, msg=name)


def test_a_loss_changing_the_stage_output_in_place_is_refused_where_resharding_breaks_it() -> None:
    reference = _reference(False)
    for got in run_distributed(worker, 2, False, True, False, timeout=120):
        assert got["error"] is None  # gathered through the step: the change is harmless
        for name, grad in reference.items():
            torch.testing.assert_close(got["grads"][name], grad, atol=TOL, rtol=TOL, msg=name)
    for got in run_distributed(worker, 2, True, True, False, timeout=120):
        assert got["error"] is not None
        assert "changed the output of pipeline stage 0 in place" in got["error"]
        assert "`out = out * s`" in got["error"] and "reshard_after_forward=False" in got["error"]
