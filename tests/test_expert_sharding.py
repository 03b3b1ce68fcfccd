"""FSDP2 with expert parallelism: experts sharded over the ranks holding the same experts.

A toy mixture-of-experts layer whose forward is exact under expert parallelism without a token
dispatch: every token goes to every expert (dense routing, weighted by a router's softmax). Under
expert parallelism a rank gathers its expert group's tokens and gates, applies its block of experts
to all of them, and the partial outputs are summed over the group, each rank keeping its own
tokens' (autograd functions below). The owner of an expert block thus gets a gradient that sums its
whole expert group's contributions, as with an all-to-all dispatch.

What this file proves (one launch of 4 ranks: dp=4, E=2, FSDP2 through
:class:`~lightning_pipe.data_parallel.fully_sharded.FullyShardedStages` and the checkpoint engine,
without a runtime, whose cutting of experts is not what is tested here):

* The expert module is its own FSDP unit over the expert-data group (2 ranks): each rank holds
  1/2 of its block of 2 experts (1/4 of the experts), the other parameters 1/4 of them over the
  whole data axis.
* Weights and Adam's state after three steps equal one device's (1e-5), with FSDP's per-backward
  reduction and with the pipeline's deferred one (two micro-batches, one reduction per step):
  expert gradients divided by the whole data axis (``expert_gradient_divisor``), not by the
  expert-data group's size (Adam's ``exp_avg`` catches a factor that its update hides).
* A checkpoint saved there holds every expert by global index (Adam's state too), and loads at
  E=4 under FSDP2 (expert-data groups of one rank) with the same values.
* A module holding both experts and other parameters is refused with the fix.
"""

from __future__ import annotations

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


def _apply(layers: Any, x: Any, stage: int) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _sharded(experts: int, deferred: bool) -> tuple[Any, Any, nn.Sequential, torch.optim.Optimizer, Any]:
    """This rank's model at dp=4 with ``experts`` expert ranks under FSDP2 (one stage), its part
    as checkpoints see it, and Adam over its shards."""
    from lightning_pipe.checkpoint.rank_state import RankPart
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages
    from lightning_pipe.experts import expert_gradient_divisor
    from lightning_pipe.experts.shard import held_block
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.partition.model import partition_model

    mesh = init_mesh(ParallelLayout(4, 1, 1, experts), "cpu")
    model = build(mesh.expert_group, mesh.layout.ep_rank(mesh.rank), experts)
    partition = partition_model(model, list(model), 1)
    sharded = FullyShardedStages(
        {0: list(model)},
        mesh.device_mesh["dp"],
        _apply,
        reshard_after_forward=not deferred,
        expert_mesh=mesh.expert_mesh["expert_data"] if mesh.expert_mesh is not None else None,
        expert_divide_factor=expert_gradient_divisor(4),
        is_expert=lambda p: held_block(p) is not None,
    )
    own = frozenset(id(p) for p in model.parameters())
    part = RankPart(model, partition, (0,), mesh.layout, mesh.coordinates, own, mesh.rank == 0)
    return sharded, part, model, torch.optim.Adam(model.parameters(), lr=0.05), mesh


def _train(sharded: Any, part: Any, optimizer: torch.optim.Optimizer) -> None:
    """The steps on this rank's quarter of each batch; with deferred reduction, as two micro-batches."""
    rank = part.coordinates.dp_rank
    for x, y in batches():
        optimizer.zero_grad()
        sharded.begin()
        pieces = 2 if sharded.deferred else 1
        for xs, ys in zip(x.chunk(4)[rank].chunk(pieces), y.chunk(4)[rank].chunk(pieces), strict=True):
            (F.mse_loss(sharded.roots[0](xs), ys) / pieces).backward()
        sharded.reduce()
        optimizer.step()


def _views(part: Any, optimizer: torch.optim.Optimizer, whole: bool = False) -> Any:
    from lightning_pipe.data_parallel.sharded_state import ShardedStateView
    from lightning_pipe.experts.shard import held_block

    dp_rank, e = part.coordinates.dp_rank, part.layout.expert_parallel_size
    blocks = frozenset(id(p) for g in optimizer.param_groups for p in g["params"] if held_block(p))
    # As ParallelRuntime.logical gives it: the writers keep what they write.
    return ShardedStateView(
        optimizer,
        keep_whole=whole or dp_rank == 0,
        to_host=not whole,
        keep_experts=whole or dp_rank < e,
        experts=blocks,
    )


def fsdp_worker(root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_pipe.checkpoint import rank_state
    from lightning_pipe.checkpoint.full import gather_model_state

    sharded, part, model, optimizer, mesh = _sharded(2, deferred=False)
    weight = model[1].experts.weight
    assert isinstance(weight, DTensor)
    held = {
        "expert_local": tuple(weight.to_local().shape),
        "expert_mesh": weight.device_mesh.size(),
        "router_local": tuple(model[1].router.weight.to_local().shape),
        "expert_units": sharded.expert_units,
    }
    _train(sharded, part, optimizer)
    path = str(Path(root) / "fsdp.ckpt")
    checkpoint = {
        "state_dict": rank_state.model_state(part),
        "optimizer_states": [rank_state.optimizer_state(part, _views(part, optimizer))],
    }
    rank_state.write(part, path, checkpoint)
    gathered = gather_model_state(model, part.partition, mesh)
    # Deferred reduction (a pipeline's: once per window, after two micro-batches).
    sharded_d, part_d, model_d, optimizer_d, _ = _sharded(2, deferred=True)
    _train(sharded_d, part_d, optimizer_d)
    # Loaded at E=4 under FSDP2: each rank one expert, expert-data groups of one rank.
    _, part4, model4, optimizer4, _ = _sharded(4, deferred=False)
    view4 = _views(part4, optimizer4)
    loaded = rank_state.read(part4, path, [view4])
    rank_state.load_model(part4, loaded)
    rank_state.load_optimizers(part4, loaded, [view4])
    names = [n for n, _ in model4.named_parameters()]
    state4 = _views(part4, optimizer4, whole=True).state_dict()["state"]
    return {
        **held,
        "gathered": gathered,
        "deferred": {n: p.full_tensor().clone() for n, p in model_d.named_parameters()},
        "E4_weights": {n: p.full_tensor().clone() for n, p in model4.named_parameters()},
        "E4_state": {names[i]: s for i, s in state4.items()},
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
        assert r["expert_units"] == 1
    for name, value in weights.items():
        torch.testing.assert_close(got[0]["gathered"][name], value, atol=TOL, rtol=0, msg=name)
    for rank, r in enumerate(got):
        _check_blocks(r["deferred"], weights, 2, rank, "deferred")
    consolidated = consolidate_checkpoint(tmp_path / "fsdp.ckpt")
    (saved,) = consolidated["optimizer_states"]
    for position, (name, value) in enumerate(weights.items()):
        torch.testing.assert_close(consolidated["state_dict"][name], value, atol=TOL, rtol=0, msg=name)
        for key, expected in state[name].items():
            torch.testing.assert_close(
                saved["state"][position][key], expected, atol=TOL, rtol=0, msg=f"{name} {key}"
            )
    for rank, r in enumerate(got):
        _check_blocks(r["E4_weights"], weights, 4, rank, "E=4")
        for name, entries in state.items():
            for key, v in entries.items():
                cut = v[rank : rank + 1] if name in _expert_shapes() and v.dim() > 0 else v
                torch.testing.assert_close(
                    r["E4_state"][name][key], cut, atol=TOL, rtol=0, msg=f"{name} {key}"
                )


def _check_blocks(
    held: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], experts: int, rank: int, where: str
) -> None:
    """``held`` (a rank's whole values) equal one device's ``weights``, of the experts its block."""
    local = NUM_EXPERTS // experts
    first = (rank % experts) * local
    assert set(held) == set(weights)
    for name, value in held.items():
        expected = weights[name][first : first + local] if name in _expert_shapes() else weights[name]
        torch.testing.assert_close(value, expected, atol=TOL, rtol=0, msg=f"{where} rank {rank} {name}")


def test_a_module_holding_experts_and_other_parameters_is_refused() -> None:
    from lightning_pipe.data_parallel.fully_sharded import ExpertShardingError, expert_modules
    from lightning_pipe.experts import ExpertShard, mark_expert_shard
    from lightning_pipe.experts.shard import held_block

    def is_block(p: torch.Tensor) -> bool:
        return held_block(p) is not None

    layer = Experts(0, 2)
    layer.scale = nn.Parameter(torch.ones(D))
    mark_expert_shard(layer.weight, ExpertShard(NUM_EXPERTS, 0, 2))
    mark_expert_shard(layer.bias, ExpertShard(NUM_EXPERTS, 0, 2))
    with pytest.raises(ExpertShardingError, match=r"holds blocks of experts \(\['weight', 'bias'\]\) and "):
        expert_modules([layer], is_block)
    del layer.scale
    assert expert_modules([nn.Sequential(layer)], is_block) == [layer]
    assert expert_modules([layer], None) == []
