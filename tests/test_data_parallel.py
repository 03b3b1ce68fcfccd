"""Data parallelism: the bucketed reducer, tied weights across stages, unused parameters.

Every layout trains to the weights of one device on the whole batch (within 1e-5), with
accumulate_grad_batches=2; and all-reduces counted at torch.distributed show that none is issued
before the last backward of an optimizer step and that bucket all-reduces start while that
backward still runs.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeTPStrategy
from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.execution import PipelineExecutor
from lightning_pipe.schedule import build_schedule
from tests.distributed import run_distributed
from tests.lightning_models import TOKENS, Regressor, TiedLM, dataset, loader
from tests.trainers import fit

pytestmark = pytest.mark.distributed

TOL = 1e-5
TRAINING = {"max_epochs": 2, "accumulate_grad_batches": 2}  # every layout, and one device


def _reference(model: L.LightningModule, ds: TensorDataset, batch: int) -> dict[str, torch.Tensor]:
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
    fit(model, "auto", 1, DataLoader(ds, batch_size=batch, sampler=sampler), **TRAINING)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def layout_worker(kind: str, pp: int) -> dict[str, Any]:
    model = Regressor() if kind == "mlp" else TiedLM(unused=kind == "unused")
    strategy = PipeTPStrategy(
        pipeline_parallel_size=pp, num_microbatches=2, timeout=timedelta(seconds=60), bucket_cap_mb=0.0005
    )
    world = int(os.environ["WORLD_SIZE"])  # the Trainer initialises the process group itself
    per_replica = 8 // (world // pp)
    data = (
        loader(dataset(40, seed=1), per_replica, reference=False)
        if kind == "mlp"
        else DataLoader(TOKENS, batch_size=per_replica)
    )
    fit(model, strategy, world, data, **TRAINING)
    c = strategy.mesh.coordinates
    return {
        "coords": (c.dp_rank, c.pp_rank),
        "gradient_sharding": strategy.runtime.gradient_sharding.name,
        "buckets": strategy.runtime.gradients.reducer.bucket_sizes
        if strategy.runtime.gradients.reducer
        else [],
        "params": {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if strategy.runtime.partition.stage_of_key(n) == strategy.pp_rank
        },
        "tied_copy": model.head.weight.detach().clone() if kind != "mlp" else None,
    }


def _check(got: list[dict[str, Any]], ref: dict[str, torch.Tensor], pp: int) -> None:
    for replica in range(len(got) // pp):
        merged = {n: p for r in got[replica * pp : (replica + 1) * pp] for n, p in r["params"].items()}
        assert merged.keys() == ref.keys()
        for name, expected in ref.items():
            torch.testing.assert_close(merged[name], expected, atol=TOL, rtol=0, msg=name)


def test_dp2_alone_with_several_buckets() -> None:
    got = run_distributed(layout_worker, 2, "mlp", 1, timeout=300, init_group=False)
    assert len(got[0]["buckets"]) > 2, "the tiny bucket cap must make several buckets"
    assert {r["gradient_sharding"] for r in got} == {"NONE"}
    _check(got, _reference(Regressor(), dataset(40, seed=1), 8), pp=1)


def test_tied_embedding_and_head_across_stages() -> None:
    got = run_distributed(layout_worker, 4, "tied", 2, timeout=300, init_group=False)
    ref = _reference(TiedLM(), TOKENS, 8)
    _check(got, ref, pp=2)
    # Both stages' copies of the tied weight stay identical, and equal to one device's.
    for r in got:
        torch.testing.assert_close(r["tied_copy"], ref["embed.weight"], atol=TOL, rtol=0)


def test_unused_parameter_neither_hangs_nor_moves() -> None:
    got = run_distributed(layout_worker, 2, "unused", 1, timeout=300, init_group=False)
    ref = _reference(TiedLM(unused=True), TOKENS, 8)
    _check(got, ref, pp=1)
    # AdamW would decay it if it had received a zero gradient instead of none.
    unused = "blocks.1.inner.never_called.weight"
    torch.testing.assert_close(got[0]["params"][unused], TiedLM(unused=True).get_parameter(unused).detach())


def events_worker() -> dict[str, Any]:
    """Record, at the torch.distributed boundary and with the test's own gradient hooks, when each
    all-reduce is issued and when each gradient becomes ready (the reducer reports nothing)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6) for _ in range(6)]
    params = [p for layer in layers for p in layer.parameters()]
    reducer = GradientReducer(params, dist.group.WORLD, bucket_cap_mb=0.0002)
    events: list[tuple[str, int]] = []
    for position, param in enumerate(params):  # after the reducer's hooks: they run first
        param.register_post_accumulate_grad_hook(
            lambda p, position=position: events.append(("ready", position))
        )
    all_reduce = dist.all_reduce

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted_all_reduce  # type: ignore[assignment]
    try:
        executor = PipelineExecutor({0: layers}, 1, [dist.get_rank()], torch.device("cpu"))
        schedule = build_schedule("1f1b", 1, 4)
        inputs = [torch.randn(3, 6) for _ in range(4)]

        def head(out: torch.Tensor, i: int) -> torch.Tensor:
            return out.pow(2).mean()

        reducer.attach()
        executor.run(schedule, 0, inputs=inputs, head=head)  # an accumulation step: must stay local
        accumulation = list(events)
        events.clear()
        # the optimizer step's batch
        executor.run(schedule, 0, inputs=inputs, head=head, before_last_backward=reducer.arm)
        during = list(events)
        events.clear()
        reducer.finish()
        after = list(events)
    finally:
        dist.all_reduce = all_reduce  # type: ignore[assignment]
    return {"accumulation": accumulation, "during": during, "after": after, "buckets": reducer.bucket_sizes}


def test_collectives_only_in_the_last_backward_and_overlapped() -> None:
    for r in run_distributed(events_worker, 2, timeout=120):
        buckets = len(r["buckets"])
        assert buckets >= 3
        assert [kind for kind, _ in r["accumulation"]].count("all_reduce") == 0, "accumulation stays local"
        during = r["during"]
        launches = [i for i, (kind, _) in enumerate(during) if kind == "all_reduce"]
        readies = [i for i, (kind, _) in enumerate(during) if kind == "ready"]
        # 4 micro-batches: every parameter's gradient is ready 4 times in this step.
        assert len(readies) == 4 * 12
        # Every bucket but the last (which fills with the backward's final gradient) is issued
        # before backward ends, i.e. before the last gradient is ready: the exchange overlaps it.
        assert len(launches) >= buckets - 1
        assert launches[buckets - 2] < readies[-1]
        last_of_third_backward = readies[3 * 12 - 1]
        assert all(i > last_of_third_backward for i in launches), "issued in the last backward only"
        assert [kind for kind, _ in r["after"]].count("all_reduce") == buckets - len(launches)


def bucket_view_worker() -> list[dict[str, Any]]:
    """Windows of 1 and 3 backwards after ``zero_grad(set_to_none=True)`` and ``False``, a layer
    only rank 0 uses: each window's averaged gradients, where they live, and the reference (every
    rank's plain summed gradients, averaged)."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])
    params = list(layers.parameters())
    reducer = GradientReducer(params, dist.group.WORLD, bucket_cap_mb=0.0002)
    windows = []
    for window, (set_to_none, backwards) in enumerate([(True, 1), (True, 3), (False, 1), (False, 3)]):
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        reducer.attach()
        local = [torch.zeros_like(p) for p in params]
        for k in range(backwards):
            if k == backwards - 1:
                reducer.arm()
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(100 * window + 10 * k + rank))
            y = layers[0](x)
            y = layers[1](y) if rank == 0 else y  # layer 1: rank 0's only
            loss = layers[3](layers[2](y)).pow(2).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
            for acc, g in zip(local, grads, strict=True):
                if g is not None:
                    acc += g
            loss.backward()
        reducer.finish()
        summed = [torch.stack(parts).mean(0) for parts in zip(*_all_gathered(local), strict=True)]
        buffers = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.nbytes) for b in reducer._buckets]
        inside = all(
            any(lo <= p.grad.data_ptr() < hi for lo, hi in buffers) for p in params if p.grad is not None
        )
        windows.append({"grads": [p.grad.clone() for p in params], "expected": summed, "inside": inside})
    return windows


def _all_gathered(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensors)
    return parts


def test_gradients_live_in_their_buckets_and_are_averaged() -> None:
    """DDP's ``gradient_as_bucket_view``: after each window every ``.grad`` is its bucket slice and
    holds the average of the replicas' summed gradients, whether ``zero_grad`` set it to ``None``
    (the new gradient moved in, divided on the way) or zeroed it, over one backward or three, a
    parameter one replica did not use included."""
    for windows in run_distributed(bucket_view_worker, 2, timeout=120):
        for w in windows:
            assert w["inside"], "a gradient outside its bucket"
            for got, want in zip(w["grads"], w["expected"], strict=True):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
