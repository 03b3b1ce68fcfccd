"""Skip connections in the engine, without a Trainer: the awkward cases, each against the same
layers chained on one process (every parameter's gradient, two steps, 1e-5).

* the stage output is itself a stashed tensor;
* one stash popped on its own stage and on two later ones (gradients summed at the producer);
* a popped tensor the consumer does not use (a zero gradient goes back);
* stashes that need no gradient: detached, and integer;
* a stage whose output *is* a popped tensor (a leaf of the stage, not a new one);
* a stash of the stage's received input;
* a dense pattern of skips within and across stages and ranks (interleaved: handed on within a
  rank), evaluation included;

under 1F1B and ZB-H1 with recomputation at pp=4, and interleaved 1F1B with 2 stages per rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pop, Stash, skippable, stash
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.schedule import build_schedule
from lightning_pipe.skip import skip_scope
from lightning_pipe.skip.plan import SkipLayers
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

D, M, TOL = 4, 3, 1e-5


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, *popped: torch.Tensor) -> torch.Tensor:
        for extra in popped:
            x = x + extra.to(x.dtype)
        return torch.tanh(self.lin(x))


class Second(nn.Module):
    """Returns what it popped: the stage's output is a leaf of the stage."""

    def forward(self, x: torch.Tensor, popped: torch.Tensor) -> torch.Tensor:
        return popped


class Ignore(Lin):
    """Pops, and does not use it."""

    def forward(self, x: torch.Tensor, *popped: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@skippable(stash=["n"])
class StashNoGrad(Lin):
    """Stashes a tensor without a gradient: detached, or integer."""

    def __init__(self, integer: bool) -> None:
        super().__init__()
        self.integer = integer

    def forward(self, x: torch.Tensor, *popped: torch.Tensor) -> torch.Tensor:
        stash("n", (x * 0 + 2).long() if self.integer else x.detach() * 3)
        return torch.tanh(self.lin(x))


def _layers(case: str) -> list[nn.Module]:
    torch.manual_seed(0)
    dense = [
        Stash("a", Lin()), Stash("b", Lin()), Pop("a", Stash("c", Lin())), Pop(["b", "c"], Lin()),
        Pop("a", Stash("d", Lin())), Pop(["d", "c"], Lin()), Pop("b", Lin()), Pop(["a", "d"], Lin()),
    ]  # fmt: skip
    return {
        "output_stashed": lambda: [Stash("a", Lin()), Lin(), Pop("a", Lin()), Lin()],
        "popped_three_times": lambda: [Stash("a", Lin()), Pop("a", Lin()), Pop("a", Lin()), Pop("a", Lin())],
        "unused": lambda: [Stash("a", Lin()), Lin(), Pop("a", Ignore()), Lin()],
        "detached": lambda: [StashNoGrad(False), Lin(), Pop("n", Lin()), Lin()],
        "integer": lambda: [StashNoGrad(True), Lin(), Pop("n", Lin()), Lin()],
        "output_popped": lambda: [Stash("a", Lin()), Lin(), Pop("a", Second()), Lin()],
        "input_stashed": lambda: [Lin(), Stash("a", nn.Identity()), Lin(), Pop("a", Lin())],
        "dense": lambda: dense,
    }[case]()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, D, generator=g), torch.randn(3, D, generator=g)) for _ in range(M)]


def _reference(case: str, training: bool) -> Any:
    inner, skips = SkipLayers.of(_layers(case))
    layers = skips.wrap(inner)
    outputs = []
    for x, y in _data():
        with skip_scope():
            for layer in layers:
                x = layer(x)
        if training:
            (F.mse_loss(x, y) / M).backward()
        outputs.append(x.detach())
    if not training:
        return outputs
    # A layer whose output nothing uses gets no gradient on one device, zeros in the pipeline (its
    # stage receives a zero gradient for its output): compared as zeros.
    return {
        f"{k}.{n}": p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for k, layer in enumerate(inner)
        for n, p in layer.named_parameters()
    }


def worker(cases: list[str], kind: str, v: int, recompute: str, training: bool) -> list[Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    data = _data()
    results = []
    for case in cases:
        inner, skips = SkipLayers.of(_layers(case))
        layers = skips.wrap(inner)
        n = p * v
        per = len(layers) // n
        stage_of = [k // per for k in range(len(layers))]
        routes = skips.plan.routes(stage_of.__getitem__)
        schedule = build_schedule(
            kind, n, M, training=training, virtual_stages=v, skips=[(r.producer, r.consumer) for r in routes]
        )
        mine = schedule.stages_of(rank)
        executor = PipelineExecutor(
            {s: layers[s * per : (s + 1) * per] for s in mine}, n, list(range(p)), torch.device("cpu"),
            recompute=recompute, skips=routes,
            skip_declarations={s: skips.plan.declared_by(range(s * per, (s + 1) * per)) for s in mine},
        )  # fmt: skip
        for _ in range(2):  # the second step with the headers cached
            for layer in inner:
                for param in layer.parameters():
                    param.grad = None
            result = executor.run(
                schedule, rank, inputs=[x for x, _ in data],
                head=(lambda o, i: F.mse_loss(o, data[i][1])) if training else (lambda o, i: o.detach()),
                signatures=[("same",)] * M,
            )  # fmt: skip
        grads = {
            f"{k}.{name}": param.grad.clone()
            for s in mine
            for k in range(s * per, (s + 1) * per)
            for name, param in inner[k].named_parameters()
            if param.grad is not None
        }
        results.append({"routes": routes, "grads": grads, "outputs": result.outputs})
    return results


CASES = [
    "output_stashed",
    "popped_three_times",
    "unused",
    "detached",
    "integer",
    "output_popped",
    "input_stashed",
]


@pytest.mark.parametrize(
    ("kind", "recompute"), [("1f1b", "never"), ("zb_h1", "always"), ("gpipe", "except_last")]
)
def test_awkward_skips_match_one_device(kind: str, recompute: str) -> None:
    got = run_distributed(worker, 4, CASES, kind, 1, recompute, True, timeout=240)
    for c, case in enumerate(CASES):
        expected = _reference(case, True)
        merged = {k: g for rank in got for k, g in rank[c]["grads"].items()}
        assert got[0][c]["routes"], case
        assert merged.keys() == expected.keys(), case
        for key, value in expected.items():
            torch.testing.assert_close(merged[key], value, atol=TOL, rtol=0, msg=f"{case}: {key}")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_dense_skips_within_and_across_ranks(training: bool) -> None:
    """Interleaved, 2 ranks x 2 stages: stages 0 and 2 share rank 0, so some routes are handed on
    within the rank and others sent."""
    got = run_distributed(worker, 2, ["dense"], "interleaved_1f1b", 2, "always", training, timeout=240)
    routes = got[0][0]["routes"]
    assert {(r.producer, r.consumer) for r in routes} >= {(0, 2), (0, 1)}  # within and across ranks
    expected = _reference("dense", training)
    if training:
        merged = {k: g for rank in got for k, g in rank[0]["grads"].items()}
        for key, value in expected.items():
            torch.testing.assert_close(merged[key], value, atol=TOL, rtol=0, msg=key)
    else:
        outputs = got[1][0]["outputs"]  # the last stage (3) lives on rank 1
        for i in range(M):
            torch.testing.assert_close(outputs[i], expected[i], atol=TOL, rtol=0)
