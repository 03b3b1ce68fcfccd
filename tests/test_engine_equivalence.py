"""The pipeline engine on real processes (gloo) equals the same network on one process.

For p in {2, 4}, GPipe, 1F1B and zero-bubble ZB-H1 (backward split into input and weight
gradients), m in {1, 3, 8} and checkpoint in {never, always} (plus
except_last), the loss and every parameter's gradient match a single-device run on the whole batch
within 1e-6; sequence lengths that change between micro-batches and between steps, and weights
after several optimizer steps, are checked too. All cases of one pipeline size share one spawned
world to keep CI fast.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_pipe.batches.microbatch import signature
from lightning_pipe.execution.executor import PipelineExecutor
from lightning_pipe.execution.layers import apply_layers
from lightning_pipe.partition.balance import compute_balance, split_layers
from lightning_pipe.schedule.builders import build_schedule
from tests.distributed import run_distributed
from tests.models import make_batch, tuple_net

pytestmark = pytest.mark.distributed

TOL = 1e-6
KINDS = ["gpipe", "1f1b", "zb_h1"]
BATCH, SEQ = 24, 5


def _case(kind: str, m: int, checkpoint: str, **extra: Any) -> dict[str, Any]:
    x, y = make_batch(BATCH, SEQ, seed=m)
    steps = [list(zip(x.chunk(m), y.chunk(m), strict=True))]
    return {
        "id": f"{kind}-m{m}-{checkpoint}",
        "kind": kind,
        "m": m,
        "checkpoint": checkpoint,
        "steps": steps,
        "sgd": False,
        **extra,
    }


def _cases() -> list[dict[str, Any]]:
    cases = [
        _case(kind, m, ckpt) for kind, m, ckpt in itertools.product(KINDS, [1, 3, 8], ["never", "always"])
    ]
    cases += [_case(kind, 3, "except_last") for kind in KINDS]
    # Receives posted at their turn instead of one exchange early (the NCCL default).
    cases += [dict(_case(kind, 8, "never"), id=f"{kind}-m8-at-turn", early=False) for kind in KINDS]
    # Sequence length changes between micro-batches and between steps; shapes repeat in step 3,
    # so the header cache must make step 3 send no header at all.
    varlen_steps = []
    for step, seqs in enumerate([(3, 5, 4, 3), (7, 7, 2, 7), (3, 5, 4, 3)]):
        mbs = [make_batch(3, s, seed=100 + 10 * step + i) for i, s in enumerate(seqs)]
        varlen_steps.append(mbs)
    for kind in KINDS:
        cases.append(
            {
                "id": f"{kind}-varlen",
                "kind": kind,
                "m": 4,
                "checkpoint": "never",
                "steps": varlen_steps,
                "sgd": True,
            }
        )
    return cases


CASES = _cases()


def engine_worker(cases: list[dict[str, Any]]) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for case in cases:
        layers = list(tuple_net(seed=0))
        balance = compute_balance(layers, p, "uniform")
        stage_layers = split_layers(layers, balance)[rank]
        offset = sum(balance[:rank])
        named = {
            f"{offset + k}.{n}": param
            for k, layer in enumerate(stage_layers)
            for n, param in layer.named_parameters()
        }
        executor = PipelineExecutor(
            {rank: stage_layers}, p, list(range(p)), torch.device("cpu"), recompute=case["checkpoint"]
        )
        executor.receive_early = case.get("early", True)  # on for every schedule unless the case says
        params = list(named.values())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if case["sgd"] else None
        losses, grads, headers = [], [], []
        for mbs in case["steps"]:
            for param in params:
                param.grad = None
            schedule = build_schedule(case["kind"], p, case["m"])
            sizes = [x.shape[0] for x, _ in mbs]
            weights = [s / sum(sizes) for s in sizes]
            before = executor.transport.headers_sent
            result = executor.run(
                schedule,
                rank,
                inputs=[x for x, _ in mbs],
                head=lambda output, i, mbs=mbs: F.mse_loss(output, mbs[i][1]),
                weights=weights,
                signatures=[signature(x) for x, _ in mbs],
            )
            headers.append(executor.transport.headers_sent - before)
            if rank == p - 1:
                losses.append(sum(w * result.outputs[i].item() for i, w in enumerate(weights)))
            grads.append({n: q.grad.clone() for n, q in named.items()})
            if opt is not None:
                opt.step()
        out[case["id"]] = {
            "losses": losses,
            "grads": grads,
            "headers": headers,
            "weights": {n: q.detach().clone() for n, q in named.items()},
            "early": executor.receives_posted_early,
        }
    return out


def reference(case: dict[str, Any]) -> dict[str, Any]:
    model = tuple_net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if case["sgd"] else None
    losses, grads = [], []
    for mbs in case["steps"]:
        model.zero_grad(set_to_none=True)
        if len({x.shape[1] for x, _ in mbs}) == 1:
            # One batch on one device: the claim is equality with this, not with micro-batching.
            x = torch.cat([x for x, _ in mbs])
            y = torch.cat([y for _, y in mbs])
            loss = F.mse_loss(apply_layers(model, x), y)
        else:
            total = sum(x.shape[0] for x, _ in mbs)
            loss = sum(F.mse_loss(apply_layers(model, x), y) * (x.shape[0] / total) for x, y in mbs)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
        if opt is not None:
            opt.step()
    return {
        "losses": losses,
        "grads": grads,
        "weights": {n: q.detach().clone() for n, q in model.named_parameters()},
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def pipeline_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    p = request.param
    return p, run_distributed(engine_worker, p, CASES, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_pipeline_matches_single_device(
    pipeline_run: tuple[int, list[dict[str, Any]]], case: dict[str, Any]
) -> None:
    p, per_rank = pipeline_run
    ref = reference(case)
    got = [r[case["id"]] for r in per_rank]
    # The loss lives on the last stage only.
    assert got[-1]["losses"] == pytest.approx(ref["losses"], abs=TOL, rel=0)
    for step, ref_grads in enumerate(ref["grads"]):
        merged = {n: g for r in got for n, g in r["grads"][step].items()}
        assert merged.keys() == ref_grads.keys(), "every parameter must live on exactly one stage"
        for name, expected in ref_grads.items():
            torch.testing.assert_close(
                merged[name], expected, atol=TOL, rtol=0, msg=f"grad {name}, step {step}"
            )
    if case["sgd"]:
        weights = {n: w for r in got for n, w in r["weights"].items()}
        for name, expected in ref["weights"].items():
            torch.testing.assert_close(weights[name], expected, atol=TOL, rtol=0, msg=f"weight {name}")
    # Receives are posted early wherever shapes are known (all but the first exchange of each
    # channel with a new shape), and never when asked not to.
    early = [r["early"] for r in got]
    if case.get("early", True) and case["m"] > 1:
        assert all(n > 0 for n in early), early
    if not case.get("early", True):
        assert early == [0] * p
    if case["id"].endswith("varlen"):
        # Step 3 repeats step 1's shapes: no header may travel. Step 1 needs one per distinct shape.
        senders = got[:-1]
        assert [r["headers"][2] for r in senders] == [0] * (p - 1)
        assert [r["headers"][0] for r in senders] == [3] * (p - 1)
