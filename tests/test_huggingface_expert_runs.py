"""A Hugging Face mixture-of-experts model through the runtime with its experts split (issue 45):
checkpoints saved at ``expert_parallel_size=2`` resume elsewhere, and FSDP2 and ZeRO-1 shard the
experts.

One launch of two gloo processes runs tiny mixtral (float64, its eager experts) with Adam:

* trained two steps at dp=2 x E=2 and saved through ``ParallelRuntime.save_checkpoint`` (each rank
  of the expert group writes its block, by global expert index), then resumed at E=1 (dp=2) and
  without data parallelism (dp=1, pp=2), each taking two further steps: the weights equal those of
  one process taking the four steps uninterrupted (1e-9), which they only do when Adam's moments
  and step count came back too;
* the same checkpoint consolidated (``python -m lightning_pipe.consolidate``) and loaded into the
  plain model and ``torch.optim.Adam`` in this process (a one-process resume): the full expert
  tensors and Adam's state equal the reference's after two steps, and two further steps equal the
  uninterrupted run; exported to a Hugging Face directory, ``from_pretrained`` gives those weights;
* trained three steps at dp=2 x E=2 with ``shard_parameters=True`` (the expert modules their own
  FSDP units over the expert-data mesh) and gradient clipping: the norms and weights equal one
  process's (1e-9); in the same launch a qwen3_moe with ``shard_optimizer_state=True`` (ZeRO-1: the
  experts' buckets sharded over the expert-data group), clipped: losses, norms and weights equal
  one process's (1e-9), each rank holding Adam's state of its own block of experts only.

A launch of four processes saves a ZeRO-1 run at dp=2 x pp=2 x E=2 and resumes it at dp=4 x E=4
and dp=4 x E=2 (ZeRO-1 both); this process resumes it consolidated (see that test).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.consolidate import main as consolidate_main
from lightning_pipe.experts import expert_shard
from lightning_pipe.huggingface import CausalLMPipeline
from lightning_pipe.mesh import MeshAxis, ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
from tests.distributed import run_distributed
from tests.hf_families import batches, reference_loss
from tests.test_huggingface_experts import BATCH, _head, build

LR = 0.01
CLIP = 0.05
BEFORE, AFTER = 2, 2
DATA = batches("padded", BEFORE + AFTER, BATCH)


def _runtime(
    sizes: tuple[int, int, int], experts: int, family: str = "mixtral", **options: Any
) -> tuple[Any, nn.Module, Any, Any]:
    layout = ParallelLayout(*sizes, expert_parallel_size=experts)
    mesh = init_mesh(layout, "cpu")
    model = build(family)
    pipeline = CausalLMPipeline(model)
    plan = pipeline.expert_parallel_plan(experts) if experts > 1 else None
    runtime = ParallelRuntime(
        model,
        pipeline.layers(),
        mesh,
        torch.device("cpu"),
        RuntimeOptions(
            **{"num_microbatches": 2, "timeout": timedelta(seconds=60), **options},
            expert_parallel_size=experts,
            expert_parallel_plan=plan,
        ),
        seed=0,
        hooks=pipeline.hooks(),
    )
    optimizer = runtime.keep_own(torch.optim.Adam(model.parameters(), lr=LR))
    return runtime, model, optimizer, mesh


def _steps(
    runtime: Any, optimizer: Any, mesh: Any, data: list[dict[str, torch.Tensor]], clip: float | None = None
) -> tuple[list[float], list[float]]:
    """Train on ``data``; with ``clip``, clip by the global norm first. The batches' losses (each
    data rank's weighted by its predicted tokens, as the whole batch's mean) and the norms."""
    dp, dp_rank = mesh.layout.data_parallel_size, mesh.coordinates.dp_rank
    losses, norms = [], []
    for batch in data:
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        optimizer.zero_grad()
        runtime.begin_accumulation()
        result = runtime.train_batch(mine, _head)
        if clip is not None:
            norms.append(float(runtime.clip_grad_norm_(clip)))
        optimizer.step()
        items = float((mine["labels"][:, 1:] != -100).sum())
        both = torch.tensor([float(result.loss) * items, items], dtype=torch.float64)
        dist.all_reduce(both, group=mesh.group(MeshAxis.DATA))
        losses.append(float(both[0] / both[1]))
    return losses, norms


def _state_held(runtime: Any, model: nn.Module) -> dict[str, int]:
    """Under ZeRO-1: the elements of the expert and of the other parameters whose Adam moments
    this rank holds (each piece's ``exp_avg``), and the elements of the experts this rank holds."""
    (sharded,) = runtime.gradients.sharded.values()
    held = {"experts": 0, "others": 0, "expert parameters here": 0}
    for p in model.parameters():
        kind = "experts" if expert_shard(p) is not None else "others"
        for piece in sharded.pieces.get(id(p), []):
            held[kind] += sharded.optimizer.state[piece.tensor]["exp_avg"].numel()
        if kind == "experts":
            held["expert parameters here"] += p.numel()
    return held


def _whole(runtime: Any, model: nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 (expert blocks gathered by global expert index)."""
    state = gather_model_state(model, runtime.partition, mesh)
    runtime.close()
    return {k: v.clone() for k, v in state.items()} if mesh.rank == 0 else {}


def checkpoint_worker(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    runtime, model, optimizer, mesh = _runtime((2, 1, 1), 2)
    held = {n: expert_shard(p) for n, p in model.named_parameters() if expert_shard(p) is not None}
    assert held and all(s.local_experts == 2 for s in held.values() if s is not None), held
    _steps(runtime, optimizer, mesh, DATA[:BEFORE])
    runtime.save_checkpoint(Path(root) / "ep2", [optimizer])
    runtime.close()
    resumed = {}
    for name, sizes in (("E=1 dp=2", (2, 1, 1)), ("dp=1 pp=2", (1, 2, 1))):
        runtime, model, optimizer, mesh = _runtime(sizes, 1)
        runtime.load_checkpoint(Path(root) / "ep2", [optimizer])
        _steps(runtime, optimizer, mesh, DATA[BEFORE:])
        resumed[name] = _whole(runtime, model, mesh)
    return resumed


def sharded_worker() -> dict[str, Any]:
    """dp=2 x E=2, three clipped steps: mixtral under FSDP2, qwen3_moe under ZeRO-1."""
    torch.set_num_threads(1)
    runtime, model, optimizer, mesh = _runtime((2, 1, 1), 2, shard_parameters=True)
    _, norms = _steps(runtime, optimizer, mesh, DATA[:3], clip=CLIP)
    fsdp2 = (_whole(runtime, model, mesh), norms)
    runtime, model, optimizer, mesh = _runtime((2, 1, 1), 2, "qwen3_moe", shard_optimizer_state=True)
    losses, norms = _steps(runtime, optimizer, mesh, DATA[:3], clip=CLIP)
    held = _state_held(runtime, model)
    return {"fsdp2": fsdp2, "zero1": (_whole(runtime, model, mesh), losses, norms, held)}


def resume_worker(root: str) -> dict[str, Any]:
    """Four ranks: two steps at dp=2 x pp=2 x E=2 under ZeRO-1, saved; resumed at dp=4 x E=4 and at
    dp=4 x E=2 (ZeRO-1 each: the experts' state then sharded over expert-data groups of 1 and 2
    ranks), each checked right after loading and after two further steps, clipped by the global
    norm (each expert counted once: its slices summed over the data axis)."""
    torch.set_num_threads(1)
    runtime, model, optimizer, mesh = _runtime((2, 2, 1), 2, shard_optimizer_state=True)
    losses, _ = _steps(runtime, optimizer, mesh, DATA[:BEFORE])
    runtime.save_checkpoint(Path(root) / "zero1-ep2", [optimizer])
    runtime.close()
    got: dict[str, Any] = {"saved": losses}
    for name, experts in (("E=4 dp=4", 4), ("E=2 dp=4", 2)):
        runtime, model, optimizer, mesh = _runtime((4, 1, 1), experts, shard_optimizer_state=True)
        runtime.load_checkpoint(Path(root) / "zero1-ep2", [optimizer])
        loaded = gather_model_state(model, runtime.partition, mesh)
        loaded = {k: v.clone() for k, v in loaded.items()} if mesh.rank == 0 else {}
        losses, norms = _steps(runtime, optimizer, mesh, DATA[BEFORE:], clip=CLIP)
        held = _state_held(runtime, model)
        got[name] = (loaded, losses, norms, _whole(runtime, model, mesh), held)
    return got


def _reference(
    steps: int,
    model: nn.Module | None = None,
    optimizer: Any = None,
    start: int = 0,
    clip: float | None = None,
    norms: list[float] | None = None,
    losses: list[float] | None = None,
) -> Any:
    """One process, whole batches, Adam: the model and optimizer after ``steps`` more steps (with
    ``clip``, clipped by the global norm first, the norms appended to ``norms``; the losses to
    ``losses``)."""
    model = model if model is not None else build("mixtral")
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=LR)
    for batch in DATA[start : start + steps]:
        optimizer.zero_grad()
        loss = reference_loss(model, batch)
        loss.backward()
        if losses is not None:
            losses.append(float(loss.detach()))
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
    return model, optimizer


def _gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert sorted(k for k in expected if "rotary" not in k) == sorted(k for k in got if "rotary" not in k)
    return max((got[k] - v).abs().max().item() for k, v in expected.items() if k in got)


@pytest.mark.distributed
def test_a_checkpoint_saved_with_split_experts_resumes_without_them_and_exports(tmp_path: Path) -> None:
    resumed = run_distributed(checkpoint_worker, 2, str(tmp_path), timeout=300, pg_timeout=120)[0]
    model, optimizer = _reference(BEFORE)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    adam_at_save = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    uninterrupted = dict(_reference(AFTER, model, optimizer, start=BEFORE)[0].state_dict())
    gaps = {name: _gap(state, uninterrupted) for name, state in resumed.items()}
    # ep_rank 1 wrote its expert blocks into a file of its own.
    assert (tmp_path / "ep2" / "shard-pp0-tp0-ep1.pt").is_file()

    # One process: the consolidated checkpoint loads into the plain model and Adam.
    whole = consolidate_checkpoint(tmp_path / "ep2")
    experts = [k for k in whole["state_dict"] if ".experts." in k]
    assert experts and all(whole["state_dict"][k].shape[0] == 4 for k in experts)
    gaps["consolidated weights"] = _gap(whole["state_dict"], at_save)
    plain = build("mixtral")
    plain.load_state_dict(whole["state_dict"])
    adam = torch.optim.Adam(plain.parameters(), lr=LR)
    adam.load_state_dict(whole["optimizer_states"][0])
    names = {id(p): n for n, p in plain.named_parameters()}
    loaded = {names[id(p)]: s for p, s in adam.state.items()}
    assert sorted(loaded) == sorted(adam_at_save)
    gaps["consolidated Adam state"] = max(
        (loaded[n][k] - v).abs().max().item() for n, s in adam_at_save.items() for k, v in s.items()
    )
    resumed_here = _reference(AFTER, plain, adam, start=BEFORE)[0]
    gaps["one process resumed"] = _gap(dict(resumed_here.state_dict()), uninterrupted)

    # python -m lightning_pipe.consolidate --to-huggingface: from_pretrained gives the full experts.
    build("mixtral").config.save_pretrained(tmp_path / "config")
    hf = ["--to-huggingface", "--config", str(tmp_path / "config"), "--prefix", ""]
    assert consolidate_main([str(tmp_path / "ep2"), str(tmp_path / "hf"), *hf]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    gaps["exported"] = _gap(dict(exported.state_dict()), at_save)
    failures = [f"{what}: {gap:.2e}" for what, gap in gaps.items() if not gap <= 1e-9]
    assert failures == [], failures
    # The resumed steps moved the weights (the comparison is not of the saved weights).
    assert _gap(uninterrupted, at_save) > 1e-4


@pytest.mark.distributed
def test_fsdp2_and_zero1_with_split_experts_train_like_one_process() -> None:
    ranks = run_distributed(sharded_worker, 2, timeout=300, pg_timeout=120)
    got, norms = ranks[0]["fsdp2"]
    _zero1_trains_like_one_process(ranks)
    model = build("mixtral")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expected_norms: list[float] = []
    expected = dict(_reference(3, model, clip=CLIP, norms=expected_norms)[0].state_dict())
    # Clipping scaled every step, by the norm that counts each expert once (the expert blocks are
    # FSDP2 shards over the expert-data group: summed over the data axis, not again per group).
    assert all(n > CLIP for n in expected_norms), expected_norms
    assert max(abs(a - b) for a, b in zip(norms, expected_norms, strict=True)) <= 1e-9, (
        norms,
        expected_norms,
    )
    assert _gap(got, expected) <= 1e-9, _gap(got, expected)
    assert _gap(expected, start) > 1e-4


def _zero1_trains_like_one_process(ranks: list[dict[str, Any]]) -> None:
    """qwen3_moe at dp=2 x E=2 under ZeRO-1, clipped: losses, norms and weights equal one process,
    and each rank holds Adam's state of its own block of experts (half of them) and of a slice of
    the other parameters, each element on one rank only."""
    got, losses, norms, _ = ranks[0]["zero1"]
    model = build("qwen3_moe")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expected_losses: list[float] = []
    expected_norms: list[float] = []
    expected = dict(
        _reference(3, model, clip=CLIP, norms=expected_norms, losses=expected_losses)[0].state_dict()
    )
    assert all(n > CLIP for n in expected_norms), expected_norms
    gaps = {
        "losses": max(abs(a - b) for a, b in zip(losses, expected_losses, strict=True)),
        "norms": max(abs(a - b) for a, b in zip(norms, expected_norms, strict=True)),
        "weights": _gap(got, expected),
    }
    assert all(gap <= 1e-9 for gap in gaps.values()), gaps
    assert _gap(expected, start) > 1e-4
    experts = sum(v.numel() for k, v in start.items() if ".experts." in k)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    held = [rank["zero1"][3] for rank in ranks]
    # Every rank holds its block (1/E of the experts), and its expert-data group (one rank at
    # dp=E) all of the block's state; the other parameters' state is split over the data axis.
    assert all(h["expert parameters here"] == experts // 2 for h in held), held
    assert [h["experts"] for h in held] == [experts // 2] * 2, held
    assert sum(h["others"] for h in held) == others and all(0 < h["others"] < others for h in held), held


@pytest.mark.distributed
def test_a_zero1_checkpoint_saved_at_e2_resumes_at_e4_and_in_one_process(tmp_path: Path) -> None:
    """Saved at dp=2 x pp=2 x E=2 under ZeRO-1 (its optimizer state assembled per group), resumed at
    dp=4 x E=4, at dp=4 x E=2 and, consolidated, in one process with ``torch.optim.Adam``: the
    weights after loading are the saved ones, and the next two steps' losses, clipping norms and the
    weights after them are one process's uninterrupted run (1e-9)."""
    ranks = run_distributed(resume_worker, 4, str(tmp_path), timeout=300, pg_timeout=120)
    expected_losses: list[float] = []
    model, optimizer = _reference(BEFORE, losses=expected_losses)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    expected_norms: list[float] = []
    uninterrupted = dict(
        _reference(
            AFTER, model, optimizer, start=BEFORE, clip=CLIP, norms=expected_norms, losses=expected_losses
        )[0].state_dict()
    )
    assert all(n > CLIP for n in expected_norms), expected_norms
    got = ranks[0]
    gaps = {
        "losses before the save": max(
            abs(a - b) for a, b in zip(got["saved"], expected_losses[:BEFORE], strict=True)
        )
    }
    for name in ("E=4 dp=4", "E=2 dp=4"):
        loaded, losses, norms, last, _ = got[name]
        gaps[f"{name}: weights loaded"] = _gap(loaded, at_save)
        gaps[f"{name}: losses"] = max(
            abs(a - b) for a, b in zip(losses, expected_losses[BEFORE:], strict=True)
        )
        gaps[f"{name}: norms"] = max(abs(a - b) for a, b in zip(norms, expected_norms, strict=True))
        gaps[f"{name}: weights"] = _gap(last, uninterrupted)
    whole = consolidate_checkpoint(tmp_path / "zero1-ep2")
    plain = build("mixtral")
    plain.load_state_dict(whole["state_dict"])
    adam = torch.optim.Adam(plain.parameters(), lr=LR)
    adam.load_state_dict(whole["optimizer_states"][0])
    gaps["one process resumed"] = _gap(
        dict(_reference(AFTER, plain, adam, start=BEFORE, clip=CLIP)[0].state_dict()), uninterrupted
    )
    failures = [f"{what}: {gap:.2e}" for what, gap in gaps.items() if not gap <= 1e-9]
    assert failures == [], failures
    assert _gap(uninterrupted, at_save) > 1e-4
    # At E=4 each rank holds one expert of four and all of its state; at dp=4 x E=2 two experts,
    # and the state of about half of them (its expert-data group of two splits the bucket, whose
    # last slots carry the reducer's used flags): 1/dp of the experts, each element on one rank.
    experts = sum(v.numel() for k, v in at_save.items() if ".experts." in k)
    for name, per_rank in (("E=4 dp=4", experts // 4), ("E=2 dp=4", experts // 2)):
        held = [rank[name][4] for rank in ranks]
        assert all(h["expert parameters here"] == per_rank for h in held), (name, held)
        assert sum(h["experts"] for h in held) == experts, (name, held)
        assert all(abs(h["experts"] - experts // 4) <= 16 for h in held), (name, held)
