"""``forward`` must be the pipeline layers chained: logic around them is detected, not skipped.

Unit tests of :func:`check_forward` on the shapes of ``forward`` users write, and one
``Trainer.fit`` in which every rank stops at the first step with the message.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipeTPStrategy
from lightning_pipe.batches.forward_contract import check_forward
from tests.distributed import run_distributed_outcomes
from tests.lightning_models import Regressor, dataset, loader
from tests.trainers import fit


class Pair(nn.Module):
    """Returns a tuple: the next layer gets two positional arguments."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Join(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.spare = nn.Sequential(*self.layers)  # the same modules under a second name


CHAINED = {
    "sequential": lambda m, x: m.layers(x),
    "loop": lambda m, x: _loop(m.layers, x),
    "other-path-same-numbers": lambda m, x: m.spare(x),  # checked numerically
}

DIFFERENT = {
    "residual": (lambda m, x: x + m.layers(x), "forward does not return exactly the last pipeline layer"),
    "final-activation": (lambda m, x: torch.relu(m.layers(x)), "differs from the chained layers' by up to"),
    "scaled-input": (lambda m, x: m.layers(2 * x), "layer 0 was not called with exactly the pipeline input"),
    "skips-a-layer": (
        lambda m, x: m.layers[2](m.layers[0](x)),
        "called the pipeline layers in the order [0, 2]",
    ),
}


def _loop(layers: Any, x: Any) -> Any:
    for layer in layers:
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    return x


@pytest.mark.parametrize("name", list(CHAINED))
def test_forwards_that_chain_the_layers_pass(name: str) -> None:
    model = Model()
    error, warning = check_forward(
        lambda x: CHAINED[name](model, x), list(model.layers), model, torch.randn(3, 4)
    )
    assert (error, warning) == (None, None)


def test_tuple_outputs_chain_as_positional_arguments() -> None:
    layers = [Pair(), Join()]
    model = nn.ModuleList(layers)
    assert check_forward(lambda x: _loop(layers, x), layers, model, torch.randn(2, 3)) == (None, None)
    # nn.Sequential would pass the tuple as one argument: a different model.
    error, _ = check_forward(lambda x: layers[1](*layers[0](x)) * 1.5, layers, model, torch.randn(2, 3))
    assert error is not None and "differs from the chained layers' by up to" in error


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_logic_outside_the_layers_is_an_error(name: str) -> None:
    model = Model()
    forward, what = DIFFERENT[name]
    error, warning = check_forward(lambda x: forward(model, x), list(model.layers), model, torch.randn(3, 4))
    assert warning is None
    assert error is not None
    assert what in error
    assert "Model.forward is not its configure_pipeline() layers applied in order" in error
    assert "Move that logic into a layer" in error


def test_unimplemented_forward_passes_and_training_mode_is_restored() -> None:
    model = Model()

    def forward(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    assert check_forward(forward, list(model.layers), model, torch.randn(3, 4)) == (None, None)
    model.train()
    check_forward(lambda x: torch.relu(model.layers(x)), list(model.layers), model, torch.randn(3, 4))
    assert all(m.training for m in model.modules())


def test_a_forward_that_cannot_be_compared_is_a_warning() -> None:
    model = Model()
    model.layers[2].to(torch.device("meta"))  # another stage's layer, meta-built: nothing to run
    error, warning = check_forward(
        lambda x: torch.relu(model.layers(x)), list(model.layers), model, torch.randn(3, 4)
    )
    assert error is None and warning is not None
    assert "could not check that Model.forward equals its pipeline layers" in warning
    assert "this rank holds only its own stage (the model was built on the meta device)" in warning


class ResidualForward(Regressor):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.layers(x))


def residual_worker(root: str) -> None:
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    fit(ResidualForward(), strategy, 2, loader(dataset(16, seed=1), 8, reference=False), root, max_epochs=1)


@pytest.mark.distributed
def test_fit_stops_every_rank_when_forward_is_not_the_chain() -> None:
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed_outcomes(residual_worker, 2, root, timeout=120, init_group=False)
    for o in outcomes:
        assert o.exitcode == 1 and not o.killed, o
        assert o.error is not None
        assert (
            "Rank 0 (pp_rank 0, tp_rank 0) stopped before the step: ResidualForward.forward is not" in o.error
        )
        assert "differs from the chained layers' by up to" in o.error
    assert max(o.seconds for o in outcomes) < 50


class Scaled(nn.Module):
    """A first layer of two arguments: the input and a per-sample scale from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


class TwoArguments(L.LightningModule):
    """``pipeline_input`` returns several tensors (a list, or a tuple): the first layer is called
    with them as positional arguments, as a layer's tuple output calls the next layer, and the
    two-argument ``forward`` is checked against the layers like any other."""

    def __init__(self, as_list: bool = True, off_by_one: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Scaled(), nn.Tanh(), nn.Linear(6, 3)])
        self.as_list, self.off_by_one = as_list, off_by_one

    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_input(self, batch: Any) -> Any:
        x, y = batch
        scale = 1.0 + y[:, :1].abs()  # varies per sample, so a mix-up shows
        return [x, scale] if self.as_list else (x, scale)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = self.layers[2](self.layers[1](self.layers[0](x, scale)))
        return out + 1 if self.off_by_one else out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(*self.pipeline_input(batch)), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def two_arguments_worker(as_list: bool) -> dict[str, torch.Tensor]:
    model = TwoArguments(as_list)
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    _fit_two(model, strategy, 2, reference=False)
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}


def _fit_two(model: L.LightningModule, strategy: Any, devices: int, reference: bool) -> None:
    """The same data and steps for the pipeline and for the one-device reference."""
    fit(model, strategy, devices, loader(dataset(24, seed=1), 8, reference), max_steps=3)


@pytest.mark.distributed
@pytest.mark.parametrize("as_list", [True, False], ids=["list", "tuple"])
def test_a_pipeline_input_of_several_tensors_calls_the_first_layer_with_them(as_list: bool) -> None:
    from tests.distributed import run_distributed

    got = run_distributed(two_arguments_worker, 2, as_list, init_group=False, timeout=120)
    reference = TwoArguments(as_list)
    _fit_two(reference, "auto", 1, reference=True)
    for name, value in reference.named_parameters():
        owner = got[0] if name in got[0] and not name.startswith("layers.2") else got[1]
        torch.testing.assert_close(owner[name], value.detach(), atol=1e-6, rtol=0, msg=name)


def test_a_two_argument_forward_is_checked() -> None:
    model = TwoArguments()
    probe = (torch.randn(4, 6), torch.rand(4, 1) + 1)
    assert check_forward(model.forward, list(model.layers), model, probe) == (None, None)
    wrong = TwoArguments(off_by_one=True)
    error, _ = check_forward(wrong.forward, list(wrong.layers), wrong, probe)
    assert error is not None and "output 0 of forward differs from the chained layers' by up to 1" in error


class ClonedChain(L.LightningModule):
    """Built on the meta device (configure_model), with a ``forward`` that chains the layers on
    copies of the activations: structurally not the chain, the same numbers, and not comparable
    numerically on a rank that holds one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    def configure_pipeline(self) -> list[nn.Module]:
        assert self.layers is not None
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None
        for layer in self.layers:
            x = layer(x.clone())
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def acknowledged_worker(check: bool) -> list[str]:
    import warnings

    strategy = PipeTPStrategy(
        pipeline_parallel_size=2, num_microbatches=2, check_forward=check, timeout=timedelta(seconds=60)
    )
    with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory() as root:
        warnings.simplefilter("always")
        fit(ClonedChain(), strategy, 2, loader(dataset(16, seed=1), 8, reference=False), root, max_steps=2)
    return [str(w.message) for w in caught if "could not check" in str(w.message)]


@pytest.mark.distributed
def test_the_unchecked_forward_warning_can_be_acknowledged() -> None:
    from tests.distributed import run_distributed

    warned = run_distributed(acknowledged_worker, 2, True, init_group=False, timeout=120)
    assert (
        len(warned[0]) == 1
        and "PipeTPStrategy(check_forward=False) skips the check and this warning" in warned[0][0]
    )
    silent = run_distributed(acknowledged_worker, 2, False, init_group=False, timeout=120)
    assert silent == [[], []]
