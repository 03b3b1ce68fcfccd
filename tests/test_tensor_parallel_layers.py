"""Tensor-parallel layers, regions and vocab-parallel cross entropy on real processes (gloo).

For tp in {2, 4}, every sharded layer is built by slicing a seeded full ``torch.nn`` layer, and its
outputs, input gradients and weight/bias gradients (each rank's slice) match the unsharded layer
on the same input within 1e-6. The vocab-parallel cross entropy matches ``F.cross_entropy`` on the
full logits (loss and each rank's slice of the logits gradient), ignored tokens included. A
Megatron transformer block issues exactly two all-reduces in forward and two in backward, no
all-gather, and equals its unsharded twin. All cases of one tensor size share one spawned world;
the references are computed here, in the parent.
"""

from __future__ import annotations

import math
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.tensor_parallel.cross_entropy import (
    cross_entropy,
    gather_vocab,
    tag_vocab_parallel,
    vocab_parallel_cross_entropy,
)
from lightning_pipe.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tensor_parallel_dim,
)
from lightning_pipe.tensor_parallel.regions import count_collectives
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-6
BLOCK_TOL = 1e-5
B, S = 2, 3
IN, OUT = 8, 8  # divisible by 2 and 4
VOCAB, EMB = 16, 6
CE_B, CE_S = 2, 5
D, HEADS = 16, 4
HEAD_DIM = D // HEADS
BLOCK_S = 5
# Ignored tokens (-100) and, for tp=4 (ranges [0,4) [4,8) [8,12) [12,16)), targets on every rank.
TARGET = torch.tensor([[0, 5, -100, 9, 15], [4, -100, 12, 7, 2]])

LINEAR_CASES = [
    ("column", False),
    ("column", True),
    ("row", True),
    ("row", False),
]


def _linear_id(kind: str, flag: bool) -> str:
    return f"column-gather_output={flag}" if kind == "column" else f"row-input_is_parallel={flag}"


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


def _full_linear(fin: int, fout: int, seed: int = 0) -> nn.Linear:
    return _seeded(seed, lambda: nn.Linear(fin, fout))


def _full_embedding() -> nn.Embedding:
    return _seeded(1, lambda: nn.Embedding(VOCAB, EMB))


def _ids() -> torch.Tensor:
    # Every id once (so every rank's range is hit) plus repeats, which must accumulate gradients.
    extra = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
    return torch.cat([torch.arange(VOCAB), extra]).reshape(3, 8)


def _ce_logits() -> torch.Tensor:
    return _randn(6, CE_B, CE_S, VOCAB) * 3


class Block(nn.Module):
    """Pre-LN transformer block; the qkv projection's output is head-major ``[heads, 3, head_dim]``."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = modules["ln1"], modules["qkv"], modules["proj"]
        self.ln2, self.fc1, self.fc2 = modules["ln2"], modules["fc1"], modules["fc2"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        heads_local = self.qkv.out_features // (3 * HEAD_DIM)
        q, k, v = qkv.view(b, s, heads_local, 3, HEAD_DIM).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads_local, s, head_dim]
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, heads_local * HEAD_DIM))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _full_block_modules() -> dict[str, nn.Module]:
    def build() -> dict[str, nn.Module]:
        modules: dict[str, nn.Module] = {
            "ln1": nn.LayerNorm(D),
            "qkv": nn.Linear(D, 3 * D),
            "proj": nn.Linear(D, D),
            "ln2": nn.LayerNorm(D),
            "fc1": nn.Linear(D, 4 * D),
            "fc2": nn.Linear(4 * D, D),
        }
        with torch.no_grad():
            for name in ("ln1", "ln2"):
                modules[name].weight.normal_(1.0, 0.2)
                modules[name].bias.normal_(0.0, 0.2)
        return modules

    return _seeded(2, build)


# Which dim of each sharded block parameter is split (None: replicated).
BLOCK_SHARD_DIM = {
    "qkv.weight": 0,
    "qkv.bias": 0,
    "proj.weight": 1,
    "fc1.weight": 0,
    "fc1.bias": 0,
    "fc2.weight": 1,
}


# ----------------------------------------------------------------------------------- worker side


def _linear_case(kind: str, flag: bool, group: Any, rank: int, tp: int) -> dict[str, Any]:
    full = _full_linear(IN, OUT)
    x_full, w = _randn(1, B, S, IN), _randn(2, B, S, OUT)
    layer: nn.Module
    if kind == "column":
        layer = ColumnParallelLinear(full, group, gather_output=flag)
        x = x_full.clone().requires_grad_()
        y = layer(x)
        # A sharded output holds only this rank's slice of the full loss.
        loss = (y * (w if flag else w.chunk(tp, -1)[rank])).sum()
    else:
        layer = RowParallelLinear(full, group, input_is_parallel=flag)
        x = (x_full.chunk(tp, -1)[rank] if flag else x_full).clone().requires_grad_()
        y = layer(x)
        loss = (y * w).sum()
    loss.backward()
    return {
        "out": y.detach(),
        "x_grad": x.grad,
        "weight": layer.weight.detach(),
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "weight_dim": tensor_parallel_dim(layer.weight),
        "bias_dim": tensor_parallel_dim(layer.bias),
    }


def _embedding_case(group: Any) -> dict[str, Any]:
    layer = VocabParallelEmbedding(_full_embedding(), group)
    y = layer(_ids())
    (y * _randn(3, 3, 8, EMB)).sum().backward()
    return {
        "out": y.detach(),
        "weight_grad": layer.weight.grad,
        "weight_dim": tensor_parallel_dim(layer.weight),
    }


def _cross_entropy_case(api: str, group: Any, rank: int, tp: int) -> dict[str, Any]:
    start = rank * VOCAB // tp
    local = _ce_logits().chunk(tp, -1)[rank].clone().requires_grad_()
    if api == "vocab_parallel_cross_entropy":
        loss = vocab_parallel_cross_entropy(local, TARGET, group, start)
    else:
        loss = cross_entropy(tag_vocab_parallel(local, group, start), TARGET)
    loss.backward()
    return {"loss": loss.detach(), "grad": local.grad}


def _untagged_cross_entropy_case() -> dict[str, Any]:
    logits = _ce_logits().requires_grad_()
    loss = cross_entropy(logits, TARGET)
    loss.backward()
    return {"loss": loss.detach(), "grad": logits.grad}


def _gather_vocab_case(group: Any, rank: int, tp: int) -> dict[str, Any]:
    local = _ce_logits().chunk(tp, -1)[rank].clone().requires_grad_()
    full = gather_vocab(tag_vocab_parallel(local, group, rank * VOCAB // tp))
    (full * _randn(7, CE_B, CE_S, VOCAB)).sum().backward()
    plain = _ce_logits()
    return {"full": full.detach(), "grad": local.grad, "untagged_is_noop": gather_vocab(plain) is plain}


_TORCH_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "all_to_all",
    "all_to_all_single", "scatter", "gather", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier",
)  # fmt: skip


@contextmanager
def _count_torch_collectives() -> Iterator[Counter[str]]:
    """Count every call of torch.distributed's communication functions, whoever makes it: the
    count does not rely on the code under test reporting its own collectives."""
    counter: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in _TORCH_COLLECTIVES}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _block_case(group: Any) -> dict[str, Any]:
    modules = _full_block_modules()
    modules["qkv"] = ColumnParallelLinear(modules["qkv"], group)
    modules["proj"] = RowParallelLinear(modules["proj"], group)
    modules["fc1"] = ColumnParallelLinear(modules["fc1"], group)
    modules["fc2"] = RowParallelLinear(modules["fc2"], group)
    block = Block(modules)
    x = _randn(8, B, BLOCK_S, D).requires_grad_()
    with count_collectives() as counter, _count_torch_collectives() as issued:
        y = block(x)
        (y * _randn(9, B, BLOCK_S, D)).sum().backward()
    return {
        "counts": dict(counter),
        "issued": dict(issued),
        "out": y.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in block.named_parameters()},
    }


def _shard_error_case(layer: str, group: Any, tp: int) -> dict[str, Any]:
    size = tp + tp // 2  # 3 under tp=2, 6 under tp=4: never divisible
    try:
        if layer == "column":
            ColumnParallelLinear(nn.Linear(4, size), group)
        elif layer == "row":
            RowParallelLinear(nn.Linear(size, 4), group)
        else:
            VocabParallelEmbedding(nn.Embedding(size, 4), group)
    except ValueError as err:
        return {"size": size, "message": str(err)}
    return {"size": size, "message": None}


def _guard(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def tp_worker() -> dict[str, Any]:
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for kind, flag in LINEAR_CASES:
        out[_linear_id(kind, flag)] = _guard(_linear_case, kind, flag, group, rank, tp)
    out["embedding"] = _guard(_embedding_case, group)
    for api in ("vocab_parallel_cross_entropy", "cross_entropy"):
        out[f"ce-{api}"] = _guard(_cross_entropy_case, api, group, rank, tp)
    out["ce-untagged"] = _guard(_untagged_cross_entropy_case)
    out["gather_vocab"] = _guard(_gather_vocab_case, group, rank, tp)
    out["block"] = _guard(_block_case, group)
    for layer in ("column", "row", "vocab"):
        out[f"shard_error-{layer}"] = _guard(_shard_error_case, layer, group, tp)
    return out


# ----------------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    tp = request.param
    return tp, run_distributed(tp_worker, tp, timeout=120)


def _results(run: tuple[int, list[dict[str, Any]]], case: str) -> tuple[int, list[dict[str, Any]]]:
    tp, per_rank = run
    got = [r[case] for r in per_rank]
    errors = [f"--- rank {rank} ---\n{g['error']}" for rank, g in enumerate(got) if "error" in g]
    assert not errors, f"case {case} raised:\n" + "\n".join(errors)
    return tp, got


def _close(actual: torch.Tensor, expected: torch.Tensor, msg: str, tol: float = TOL) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize(("kind", "flag"), LINEAR_CASES, ids=[_linear_id(k, f) for k, f in LINEAR_CASES])
def test_parallel_linear_matches_nn_linear(
    tp_run: tuple[int, list[dict[str, Any]]], kind: str, flag: bool
) -> None:
    tp, got = _results(tp_run, _linear_id(kind, flag))
    ref = _full_linear(IN, OUT)
    x = _randn(1, B, S, IN).requires_grad_()
    y = ref(x)
    (y * _randn(2, B, S, OUT)).sum().backward()
    assert x.grad is not None and ref.weight.grad is not None and ref.bias.grad is not None

    if kind == "column" and not flag:
        assert [g["out"].shape[-1] for g in got] == [OUT // tp] * tp
        _close(torch.cat([g["out"] for g in got], -1), y.detach(), "gathered output")
    else:
        for rank, g in enumerate(got):
            _close(g["out"], y.detach(), f"output on rank {rank}")

    if kind == "row" and flag:
        _close(torch.cat([g["x_grad"] for g in got], -1), x.grad, "input gradient (slices)")
    else:
        for rank, g in enumerate(got):
            _close(g["x_grad"], x.grad, f"input gradient on rank {rank}")

    for rank, g in enumerate(got):
        if kind == "column":
            rows = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
            assert (g["weight_dim"], g["bias_dim"]) == (0, 0)
            _close(g["weight"], ref.weight.detach()[rows], f"weight slice on rank {rank}")
            _close(g["weight_grad"], ref.weight.grad[rows], f"weight gradient on rank {rank}")
            _close(g["bias_grad"], ref.bias.grad[rows], f"bias gradient on rank {rank}")
        else:
            cols = slice(rank * IN // tp, (rank + 1) * IN // tp)
            assert (g["weight_dim"], g["bias_dim"]) == (1, None)
            _close(g["weight"], ref.weight.detach()[:, cols], f"weight slice on rank {rank}")
            _close(g["weight_grad"], ref.weight.grad[:, cols], f"weight gradient on rank {rank}")
            # The replicated bias is added once, after the sum: its gradient is the full one.
            _close(g["bias_grad"], ref.bias.grad, f"bias gradient on rank {rank}")


def test_vocab_parallel_embedding_matches_nn_embedding(tp_run: tuple[int, list[dict[str, Any]]]) -> None:
    tp, got = _results(tp_run, "embedding")
    ref = _full_embedding()
    y = ref(_ids())
    (y * _randn(3, 3, 8, EMB)).sum().backward()
    assert ref.weight.grad is not None
    for rank, g in enumerate(got):
        rows = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
        assert g["weight_dim"] == 0
        _close(g["out"], y.detach(), f"output on rank {rank}")
        _close(g["weight_grad"], ref.weight.grad[rows], f"weight gradient on rank {rank}")


def _reference_cross_entropy() -> tuple[torch.Tensor, torch.Tensor]:
    logits = _ce_logits().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), TARGET.reshape(-1), ignore_index=-100)
    loss.backward()
    assert logits.grad is not None
    return loss.detach(), logits.grad


@pytest.mark.parametrize("api", ["vocab_parallel_cross_entropy", "cross_entropy"])
def test_vocab_parallel_cross_entropy_matches_full(
    tp_run: tuple[int, list[dict[str, Any]]], api: str
) -> None:
    tp, got = _results(tp_run, f"ce-{api}")
    loss, grad = _reference_cross_entropy()
    assert (grad.reshape(-1, VOCAB)[TARGET.reshape(-1) == -100] == 0).all(), "reference sanity"
    for rank, g in enumerate(got):
        _close(g["loss"], loss, f"loss on rank {rank}")
        _close(g["grad"], grad.chunk(tp, -1)[rank], f"logits gradient slice on rank {rank}")


def test_cross_entropy_on_untagged_logits_is_f_cross_entropy(
    tp_run: tuple[int, list[dict[str, Any]]],
) -> None:
    _, got = _results(tp_run, "ce-untagged")
    loss, grad = _reference_cross_entropy()
    for rank, g in enumerate(got):
        _close(g["loss"], loss, f"loss on rank {rank}")
        _close(g["grad"], grad, f"logits gradient on rank {rank}")


def test_gather_vocab_returns_full_logits(tp_run: tuple[int, list[dict[str, Any]]]) -> None:
    tp, got = _results(tp_run, "gather_vocab")
    w = _randn(7, CE_B, CE_S, VOCAB)
    for rank, g in enumerate(got):
        _close(g["full"], _ce_logits(), f"gathered logits on rank {rank}")
        _close(g["grad"], w.chunk(tp, -1)[rank], f"gradient of this rank's slice on rank {rank}")
        assert g["untagged_is_noop"]


def _reference_block() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    block = Block(_full_block_modules())
    x = _randn(8, B, BLOCK_S, D).requires_grad_()
    y = block(x)
    (y * _randn(9, B, BLOCK_S, D)).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters() if p.grad is not None}


def test_megatron_block_collective_count(tp_run: tuple[int, list[dict[str, Any]]]) -> None:
    _, got = _results(tp_run, "block")
    for rank, g in enumerate(got):
        # Exactly f and g twice each (attention, MLP), and no all-gather of any kind, counted both
        # by the regions and at torch.distributed's functions.
        assert g["counts"] == {"all_reduce_forward": 2, "all_reduce_backward": 2}, f"rank {rank}"
        assert g["issued"] == {"all_reduce": 4}, f"rank {rank}"


def test_megatron_block_matches_unsharded(tp_run: tuple[int, list[dict[str, Any]]]) -> None:
    tp, got = _results(tp_run, "block")
    out, x_grad, grads = _reference_block()
    for rank, g in enumerate(got):
        _close(g["out"], out, f"block output on rank {rank}", BLOCK_TOL)
        _close(g["x_grad"], x_grad, f"block input gradient on rank {rank}", BLOCK_TOL)
        assert g["grads"].keys() == grads.keys()
        for name, expected in grads.items():
            dim = BLOCK_SHARD_DIM.get(name)
            if dim is not None:
                expected = expected.chunk(tp, dim)[rank]
            _close(g["grads"][name], expected, f"grad {name} on rank {rank}", BLOCK_TOL)
    for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"):
        for rank, g in enumerate(got[1:], start=1):
            assert torch.equal(g["grads"][name], got[0]["grads"][name]), f"{name}: rank {rank} != rank 0"


@pytest.mark.parametrize("layer", ["column", "row", "vocab"])
def test_shard_range_rejects_indivisible_size(tp_run: tuple[int, list[dict[str, Any]]], layer: str) -> None:
    tp, got = _results(tp_run, f"shard_error-{layer}")
    for rank, g in enumerate(got):
        assert g["message"] is not None, f"rank {rank}: no ValueError for size {g['size']} under tp={tp}"
        assert str(g["size"]) in g["message"], g["message"]
        assert f"tensor_parallel_size={tp}" in g["message"], g["message"]


class _Uncopyable:
    """Stands in for a process group, which cannot be copied."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("cannot pickle 'ProcessGroup' object")


def test_a_module_with_sequence_hooks_can_be_deep_copied_and_shares_its_hooks() -> None:
    """The sequence-parallel hooks are objects (so that ``torch.compile`` runs them eagerly); a
    copied module (an EMA copy, say) keeps them and their group, shared, as it did their closures."""
    import copy

    from lightning_pipe.tensor_parallel.apply import _sequence_hooks
    from lightning_pipe.tensor_parallel.styles import TensorParallelStyle

    group: Any = _Uncopyable()
    gathering, scattering = nn.Linear(2, 2), nn.Linear(2, 2)
    _sequence_hooks(gathering, TensorParallelStyle.SEQUENCE_GATHER, group, has_columns=True)
    _sequence_hooks(scattering, TensorParallelStyle.SEQUENCE_SCATTER, group, has_columns=False)
    for module, hooks in ((gathering, "_forward_pre_hooks"), (scattering, "_forward_hooks")):
        copied = copy.deepcopy(module)
        assert list(getattr(copied, hooks).values()) == list(getattr(module, hooks).values())
        assert [h.group for h in getattr(copied, hooks).values()] == [group]
