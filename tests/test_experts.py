"""Expert parallelism (issue 45): the dropless dispatch over an expert group, in real gloo
processes, equal to every expert on one process (forward and backward), with uneven counts and a
rank that receives no token; the Hugging Face mixture-of-experts families at expert_parallel_size=2
are in tests/test_huggingface_experts.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.experts.dispatch import ExpertGroup, dispatch_combine
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

EXPERTS, HIDDEN, TOKENS, TOP_K = 4, 6, 5, 2


def _weights(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g, dtype=torch.float64)


def _inputs(rank: int, case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64)
    if case == "uneven":  # rank 0 sends mostly to itself, rank 1 mostly to rank 0 too
        indices = torch.tensor([[0, 1], [1, 2], [0, 3], [1, 0], [2, 1]])
    else:  # "empty": no token of any rank goes to rank 1's experts (2, 3)
        indices = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    return hidden, indices, weights


def _expert(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _reference(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for k in range(indices.shape[1]):
        for e in range(w.shape[0]):
            chosen = indices[:, k] == e
            out[chosen] += weights[chosen, k, None] * _expert(w[e], hidden[chosen])
    return out


def dispatch_worker() -> dict[str, Any]:
    return {case: _dispatch(case) for case in CASES}


def _dispatch(case: str) -> dict[str, Any]:
    rank = dist.get_rank()
    group = ExpertGroup(dist.group.WORLD, 2, rank, EXPERTS)
    block = _weights()[rank * 2 : rank * 2 + 2].clone().requires_grad_(True)
    hidden, indices, weights = _inputs(rank, case)
    hidden.requires_grad_(True)
    weights.requires_grad_(True)

    def local(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.stack([_expert(block[i], row) for row, i in zip(rows, index.tolist(), strict=True)])

    out = dispatch_combine(hidden, indices, weights, group, local, [block])
    (out * torch.arange(1.0, HIDDEN + 1, dtype=torch.float64)).sum().backward()
    assert block.grad is not None
    grads = [torch.zeros_like(block.grad) for _ in range(2)]
    dist.all_gather(grads, block.grad)
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad, "experts": torch.cat(grads)}


CASES = ("uneven", "empty")


def test_dispatch_equals_every_expert_on_one_process() -> None:
    """Two ranks, each with its tokens, each holding two of four experts: outputs and the
    gradients of the inputs, the router weights and the experts equal one process's, with uneven
    counts and with a rank that receives no token (one launch for both)."""
    launched = run_distributed(dispatch_worker, 2)
    for case in CASES:
        _compare(case, [launched[0][case], launched[1][case]])


def _compare(case: str, got: list[dict[str, Any]]) -> None:
    w = _weights().requires_grad_(True)
    expert_grad = torch.zeros_like(w)
    for rank in range(2):
        hidden, indices, weights = _inputs(rank, case)
        hidden.requires_grad_(True)
        weights.requires_grad_(True)
        out = _reference(hidden, indices, weights, w)
        (out * torch.arange(1.0, HIDDEN + 1, dtype=torch.float64)).sum().backward()
        assert w.grad is not None
        expert_grad += w.grad
        w.grad = None
        mine = got[rank]
        torch.testing.assert_close(mine["out"], out.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(mine["hidden"], hidden.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine["weights"], weights.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[0]["experts"], expert_grad, rtol=0, atol=1e-12)
    if case == "empty":  # rank 1 computed nothing: its experts' gradient is zero, not missing
        assert got[1]["experts"][2:].abs().max() == 0
