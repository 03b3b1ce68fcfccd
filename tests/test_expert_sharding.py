"""FSDP2 with expert parallelism: experts sharded over the ranks holding the same experts.

A toy mixture-of-experts layer whose forward is exact under expert parallelism without a token
dispatch: every token goes to every expert (dense routing, weighted by a router's softmax). Under
expert parallelism a rank gathers its expert group's tokens and gates, applies its block of experts
to all of them, and the partial outputs are summed over the group, each rank keeping its own
tokens' (autograd functions below). The owner of an expert block thus gets a gradient that sums its
whole expert group's contributions, as with an all-to-all dispatch.

What this file proves (one launch of 4 ranks: dp=4, E=2, ``shard_parameters=True``):

* The expert module is its own FSDP unit over the expert-data group (2 ranks): each rank holds
  1/2 of its block of 2 experts (1/4 of the experts), the other parameters 1/4 of them over the
  whole data axis; the layout log says so.
* Weights after three Adam steps equal one device's (1e-5): expert gradients divided by the whole
  data axis (``expert_gradient_divisor``), not by the expert-data group's size.
* A checkpoint saved there holds every expert by global index (Adam's state too), and loads at
  E=4 under FSDP2 (expert-data groups of one rank) with the same values.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed

NUM_EXPERTS, D = 4, 6
STEPS = 3
TOL = 1e-5


class _Gather(torch.autograd.Function):
    """Every rank's rows of ``x``, in rank order; backward: the sum of every rank's gradient of
    this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.rank].clone(), None


class _Sum(torch.autograd.Function):
    """The sum of ``x`` over the group; backward: the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Experts(nn.Module):
    """A block of ``local`` experts from global expert ``first``: ``tanh(W_e h + b_e)``, weighted by
    the gates of those experts and summed."""

    def __init__(self, first: int, local: int) -> None:
        super().__init__()
        self.first, self.local = first, local
        self.weight = nn.Parameter(torch.zeros(local, D, D))
        self.bias = nn.Parameter(torch.zeros(local, D))

    def forward(self, h: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(torch.einsum("nd,eod->neo", h, self.weight) + self.bias)
        return (z * gates[:, self.first : self.first + self.local, None]).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, group: dist.ProcessGroup | None, first: int, local: int) -> None:
        super().__init__()
        self.group = group
        self.router = nn.Linear(D, NUM_EXPERTS)
        self.experts = Experts(first, local)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h), dim=-1)  # on this rank's tokens only
        if self.group is None:
            return h + self.experts(h, gates)
        n = h.shape[0]
        both = _Gather.apply(torch.cat([h, gates], dim=-1), self.group)
        partial = self.experts(both[:, :D], both[:, D:])
        total = _Sum.apply(partial, self.group)
        rank = dist.get_rank(self.group)
        return h + total[rank * n : (rank + 1) * n]


def build(group: dist.ProcessGroup | None = None, ep_rank: int = 0, experts: int = 1) -> nn.Sequential:
    """The model with every expert (one device), or this rank's block marked (``experts`` > 1)."""
    from lightning_pipe.experts import ExpertShard, mark_expert_shard

    local = NUM_EXPERTS // experts
    model = nn.Sequential(nn.Linear(4, D), MoE(group, ep_rank * local, local), nn.Linear(D, 2))
    g = torch.Generator().manual_seed(5)
    full = {k: torch.randn(s, generator=g) * 0.5 for k, s in _expert_shapes().items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in full:
                p.copy_(full[name][ep_rank * local : (ep_rank + 1) * local])
                if experts > 1:
                    mark_expert_shard(p, ExpertShard(NUM_EXPERTS, ep_rank * local, local))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _expert_shapes() -> dict[str, torch.Size]:
    return {
        "1.experts.weight": torch.Size([NUM_EXPERTS, D, D]),
        "1.experts.bias": torch.Size([NUM_EXPERTS, D]),
    }


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(STEPS)]


def one_device() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for x, y in batches():
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _runtime(experts: int) -> tuple[Any, nn.Sequential, torch.optim.Optimizer]:
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    mesh = init_mesh(ParallelLayout(4, 1, 1, experts), "cpu")
    model = build(mesh.expert_group, mesh.layout.ep_rank(mesh.rank), experts)
    options = RuntimeOptions(
        shard_parameters=True, num_microbatches=1, check_forward=False, timeout=timedelta(seconds=60)
    )
    runtime = ParallelRuntime(model, list(model), mesh, torch.device("cpu"), options)
    return runtime, model, runtime.keep_own(torch.optim.Adam(model.parameters(), lr=0.05))


def fsdp_worker(root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_pipe.checkpoint.full import gather_model_state

    runtime, model, optimizer = _runtime(2)
    rank = runtime.mesh.coordinates.dp_rank
    weight = model[1].experts.weight
    assert isinstance(weight, DTensor)
    held = {
        "expert_local": tuple(weight.to_local().shape),
        "expert_mesh": weight.device_mesh.size(),
        "router_local": tuple(model[1].router.weight.to_local().shape),
    }
    for x, y in batches():
        optimizer.zero_grad()
        runtime.begin_accumulation()
        runtime.train_batch((x.chunk(4)[rank], y.chunk(4)[rank]), lambda out, mb: F.mse_loss(out, mb.data[1]))
        optimizer.step()
    path = str(Path(root) / "fsdp.ckpt")
    runtime.save_checkpoint(path, [optimizer])
    gathered = gather_model_state(model, runtime.partition, runtime.mesh)
    # Loaded at E=4 under FSDP2: each rank one expert, expert-data groups of one rank.
    runtime4, model4, optimizer4 = _runtime(4)
    runtime4.load_checkpoint(path, [optimizer4])
    view = runtime4.logical(optimizer4, whole_everywhere=True).state_dict()
    names = [n for n, _ in model4.named_parameters()]
    return {
        **held,
        "layout_log": runtime.describe(1),
        "gathered": gathered,
        "E4_weights": {n: p.full_tensor().clone() for n, p in model4.named_parameters()},
        "E4_state": {names[i]: s for i, s in view["state"].items()},
    }


@pytest.mark.distributed
def test_fsdp2_shards_experts_over_the_expert_data_group_and_trains_like_one_device(tmp_path: Path) -> None:
    from lightning_pipe.checkpoint import consolidate_checkpoint

    got = run_distributed(fsdp_worker, 4, str(tmp_path), timeout=240)
    weights, state = one_device()
    for r in got:
        assert r["expert_local"] == (1, D, D), "1/2 of the rank's 2 experts"
        assert r["expert_mesh"] == 2, "sharded over the expert-data group"
        assert r["router_local"] == (1, D), "the router over the whole data axis"
        assert (
            "the 1 modules holding blocks of experts over the ranks holding the same experts"
            in r["layout_log"]
        )
    for name, value in weights.items():
        torch.testing.assert_close(got[0]["gathered"][name], value, atol=TOL, rtol=0, msg=name)
    consolidated = consolidate_checkpoint(tmp_path / "fsdp.ckpt")
    (saved,) = consolidated["optimizer_states"]
    for position, (name, value) in enumerate(weights.items()):
        torch.testing.assert_close(consolidated["state_dict"][name], value, atol=TOL, rtol=0, msg=name)
        for key, expected in state[name].items():
            torch.testing.assert_close(
                saved["state"][position][key], expected, atol=TOL, rtol=0, msg=f"{name} {key}"
            )
    for rank, r in enumerate(got):
        for name, value in r["E4_weights"].items():
            expected = weights[name][rank : rank + 1] if name in _expert_shapes() else weights[name]
            torch.testing.assert_close(value, expected, atol=TOL, rtol=0, msg=f"E=4 rank {rank} {name}")
            for key, v in state[name].items():
                cut = v[rank : rank + 1] if name in _expert_shapes() and v.dim() > 0 else v
                torch.testing.assert_close(
                    r["E4_state"][name][key], cut, atol=TOL, rtol=0, msg=f"{name} {key}"
                )
