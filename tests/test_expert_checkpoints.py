"""Checkpoints of expert-parallel models: saved by global expert index, loaded at any expert size.

A tiny four-layer model holds two "mixture-of-experts" layers whose stacked expert parameters
(``(experts, ...)``, the expert dim 0, as Hugging Face's fused ``gate_up_proj`` / ``down_proj``)
each rank slices and marks by hand (:func:`~lightning_pipe.experts.shard.mark_expert_shard`) as
expert parallelism lays them out; no dispatch is needed for state to round-trip. Every rank sets
its parameters and gradients from one set of full reference tensors and takes two Adam steps, so
parameters and Adam's state (``exp_avg``, ``exp_avg_sq``, ``step``) equal, bit for bit, those of one
device taking the same steps (Adam is element-wise).

What this file proves (two launches, of 4 and 2 ranks):

* Saved at dp=2 (E=2) x pp=2, the checkpoint holds each expert block once, by global expert index
  (``shard-pp{p}-tp0-ep1.pt`` beside ``shard-pp{p}-tp0.pt``), in format version 2.
* It loads, model and Adam state equal to one device's, at E=4 (dp=4), at E=1 with dp=2, without
  data parallelism over four stages (dp=1, pp=4), and back at E=2 (dp=2, pp=1).
* A checkpoint saved without an expert axis (E=1) loads at E=2, each rank cutting its block.
* Consolidation gives the full tensors (every expert, in order) and the Adam state numbered as one
  device numbers it (``python -m lightning_pipe.consolidate`` too, naming the saving layout); the
  live single-file gather (``checkpoint/full.py``) gives them too.
* A checkpoint without expert blocks is still written as format version 1 (what every earlier
  release reads); metadata whose expert blocks do not cover the experts is refused as damaged.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint.metadata import METADATA_FILE, CheckpointError
from lightning_pipe.consolidate import main as consolidate_main
from tests.checkpoint_files import edit_metadata
from tests.distributed import run_distributed

NUM_EXPERTS = 4
STEPS = 2
EXPERT_KEYS = ("1.weight", "1.bias", "2.weight")


class Experts(nn.Module):
    """Stacked experts: ``weight`` ``(experts, out, in)`` and, optionally, ``bias`` ``(experts, out)``."""

    def __init__(self, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(NUM_EXPERTS, d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(NUM_EXPERTS, d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # not run: state only
        return x


def build_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 6), Experts(6, 3, bias=True), Experts(3, 6, bias=False), nn.Linear(6, 2)
    )


def reference_values() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Full parameters and, per step, full gradients (seeded: the same in every process)."""
    g = torch.Generator().manual_seed(11)
    shapes = {k: tuple(v.shape) for k, v in build_model().state_dict().items()}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(STEPS)]
    return params, grads


def one_device() -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The parameters and Adam state after the steps on one device, by parameter name."""
    params, grads = reference_values()
    model = build_model()
    model.load_state_dict(params)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in grads:
        for name, p in model.named_parameters():
            p.grad = step[name].clone()
        optimizer.step()
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, state


@dataclass
class Rank:
    """One rank's part of the model as the checkpoint engine sees it
    (:class:`~lightning_pipe.checkpoint.rank_state.RankPart`), and its mesh. The checkpoint calls
    are those of ``ParallelRuntime.save_checkpoint`` / ``load_checkpoint``, without a runtime:
    what cuts the experts is not what is tested here."""

    part: Any
    mesh: Any

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.part.module.parameters() if id(p) in self.part.parameters]

    def save_checkpoint(self, path: str, optimizers: list[torch.optim.Optimizer]) -> None:
        from lightning_pipe.checkpoint import rank_state

        checkpoint = {
            "state_dict": rank_state.model_state(self.part),
            "optimizer_states": [rank_state.optimizer_state(self.part, o) for o in optimizers],
        }
        rank_state.write(self.part, path, checkpoint)

    def load_checkpoint(self, path: str, optimizers: list[torch.optim.Optimizer]) -> None:
        from lightning_pipe.checkpoint import rank_state

        checkpoint = rank_state.read(self.part, path, optimizers)
        rank_state.load_model(self.part, checkpoint)
        rank_state.load_optimizers(self.part, checkpoint, optimizers)


def _runtime(dp: int, pp: int, experts: int) -> tuple[Rank, nn.Sequential, torch.optim.Optimizer]:
    """This rank's model (its experts sliced and marked), its part and Adam over its stage, at
    ``dp x pp`` with ``experts`` expert ranks."""
    from lightning_pipe.checkpoint.optimizer_view import keep_own
    from lightning_pipe.checkpoint.rank_state import RankPart
    from lightning_pipe.experts import ExpertShard, mark_expert_shard
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.partition.model import partition_model

    mesh = init_mesh(ParallelLayout(dp, pp, 1, experts), "cpu")
    model = build_model()
    if experts > 1:
        ep_rank = mesh.layout.ep_rank(mesh.rank)
        local = NUM_EXPERTS // experts
        for layer in (model[1], model[2]):
            for name, p in list(layer.named_parameters()):
                block = nn.Parameter(p.detach()[ep_rank * local : (ep_rank + 1) * local].clone())
                mark_expert_shard(block, ExpertShard(NUM_EXPERTS, ep_rank * local, local))
                setattr(layer, name, block)
    partition = partition_model(model, list(model), pp, {1: [4], 2: [2, 2], 4: [1, 1, 1, 1]}[pp])
    stages = partition.stages_of_rank(mesh.coordinates.pp_rank, pp)
    own = {id(p) for s in stages for i in partition.layer_range(s) for p in model[i].parameters()}
    part = RankPart(model, partition, stages, mesh.layout, mesh.coordinates, frozenset(own), mesh.rank == 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    keep_own(optimizer, model, own)
    return Rank(part, mesh), model, optimizer


def _cut(name: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a full ``value`` that ``param`` holds (its experts, if marked)."""
    from lightning_pipe.experts import expert_shard

    shard = expert_shard(param)
    if shard is None or value.shape == param.shape:
        return value
    return value.narrow(shard.dim, shard.first_expert, shard.local_experts)


def _train_and_save(runtime: Rank, model: nn.Sequential, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Set this rank's parameters from the reference, take the steps with its gradients, save."""
    params, grads = reference_values()
    own = {id(p) for p in runtime.parameters}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_cut(name, params[name], p))
    for step in grads:
        for name, p in model.named_parameters():
            p.grad = _cut(name, step[name], p).clone() if id(p) in own else None
        optimizer.step()
    runtime.save_checkpoint(path, [optimizer])


def _held(runtime: Rank, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this rank holds after a load: its own parameters, their Adam state and expert marks."""
    from lightning_pipe.experts import expert_shard

    own = {id(p) for p in runtime.parameters}
    names = {id(p): n for n, p in model.named_parameters()}
    held: dict[str, Any] = {"params": {}, "state": {}, "experts": {}}
    for name, p in model.named_parameters():
        if id(p) in own:
            held["params"][name] = p.detach().clone()
            shard = expert_shard(p)
            held["experts"][name] = None if shard is None else shard.experts
    for p, state in optimizer.state.items():
        held["state"][names[id(p)]] = {k: v.clone() for k, v in state.items()}
    return held


def _load(dp: int, pp: int, experts: int, path: str) -> dict[str, Any]:
    runtime, model, optimizer = _runtime(dp, pp, experts)
    runtime.load_checkpoint(path, [optimizer])
    return _held(runtime, model, optimizer)


def save_and_load_four(root: str) -> dict[str, Any]:
    """Four ranks: save at dp=2 (E=2) x pp=2; load at E=4 (dp=4) and at dp=1 x pp=4."""
    from lightning_pipe.checkpoint.full import gather_model_state, gather_optimizer_state

    path = str(Path(root) / "experts.ckpt")
    runtime, model, optimizer = _runtime(2, 2, 2)
    _train_and_save(runtime, model, optimizer, path)
    gathered = gather_model_state(model, runtime.part.partition, runtime.mesh)
    gathered_state = gather_optimizer_state(optimizer, runtime.mesh, model)
    return {
        "E4": _load(4, 1, 4, path),
        "pp4": _load(1, 4, 1, path),
        "gathered": gathered,
        "gathered_state": gathered_state,
    }


def load_two(root: str) -> dict[str, Any]:
    """Two ranks: load the E=2 checkpoint at E=1 and E=2 (dp=2); save at E=1, load that at E=2."""
    path = str(Path(root) / "experts.ckpt")
    plain = str(Path(root) / "plain.ckpt")
    e1 = _load(2, 1, 1, path)
    e2 = _load(2, 1, 2, path)
    runtime, model, optimizer = _runtime(2, 1, 1)
    _train_and_save(runtime, model, optimizer, plain)
    return {"E1": e1, "E2": e2, "plain_at_E2": _load(2, 1, 2, plain)}


def _check(held: dict[str, Any], params: dict[str, torch.Tensor], state: dict[str, Any], where: str) -> None:
    assert held["params"], f"{where}: holds no parameter"
    for name, value in held["params"].items():
        experts = held["experts"][name]
        full = params[name]
        expected = full if experts is None else full[experts.start : experts.stop]
        assert torch.equal(value, expected), f"{where}: {name}"
        assert set(held["state"][name]) == set(state[name]), f"{where}: {name}'s state keys"
        for key, saved in state[name].items():
            cut = saved if saved.dim() == 0 or experts is None else saved[experts.start : experts.stop]
            assert torch.equal(held["state"][name][key], cut), f"{where}: {name}'s {key}"


@pytest.mark.distributed
def test_expert_checkpoints_move_between_expert_sizes_and_consolidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params, state = one_device()
    (four0, four1, four2, four3) = run_distributed(save_and_load_four, 4, str(tmp_path), timeout=180)
    two = run_distributed(load_two, 2, str(tmp_path), timeout=180)

    saved = tmp_path / "experts.ckpt"
    metadata = json.loads((saved / METADATA_FILE).read_text())
    assert metadata["version"] == 2
    assert metadata["layout"]["expert_parallel_size"] == 2
    assert sorted(p.name for p in saved.glob("shard-*.pt")) == [
        "shard-pp0-tp0-ep1.pt",
        "shard-pp0-tp0.pt",
        "shard-pp1-tp0-ep1.pt",
        "shard-pp1-tp0.pt",
    ]
    record = metadata["model"]["1.weight"]
    assert record["shape"] == [NUM_EXPERTS, 3, 6]
    assert record["expert_dim"] == 0 and record["experts"] == [[0, 2], [2, 2]]
    assert record["files"] == ["shard-pp0-tp0.pt", "shard-pp0-tp0-ep1.pt"]
    assert "expert_dim" not in metadata["model"]["0.weight"]  # replicated: one file, as before
    exp_avg = metadata["optimizers"][0]["2.weight"]["exp_avg"]
    assert exp_avg["files"] == ["shard-pp1-tp0.pt", "shard-pp1-tp0-ep1.pt"]
    # Each block once: the second expert rank's file holds experts only.
    ep1 = torch.load(saved / "shard-pp0-tp0-ep1.pt", weights_only=True)
    assert sorted(ep1["model"]) == ["1.bias", "1.weight"]
    assert torch.equal(ep1["model"]["1.weight"], params["1.weight"][2:4])

    # A checkpoint without expert blocks stays format version 1 (every earlier release reads it).
    plain = json.loads((tmp_path / "plain.ckpt" / METADATA_FILE).read_text())
    assert plain["version"] == 1 and "expert_parallel_size" not in plain["layout"]
    assert all("expert_dim" not in r for r in plain["model"].values())

    for rank, result in enumerate((four0, four1, four2, four3)):
        _check(result["E4"], params, state, f"E=4 rank {rank}")
        assert result["E4"]["experts"]["1.weight"] == range(rank, rank + 1)
        _check(result["pp4"], params, state, f"dp=1 x pp=4 rank {rank}")
    for rank, result in enumerate(two):
        _check(result["E1"], params, state, f"E=1 dp=2 rank {rank}")
        assert result["E1"]["experts"]["1.weight"] is None
        _check(result["E2"], params, state, f"E=2 dp=2 rank {rank}")
        assert result["E2"]["experts"]["1.weight"] == range(2 * rank, 2 * rank + 2)
        _check(result["plain_at_E2"], params, state, f"saved at E=1, loaded at E=2, rank {rank}")
    # Every stage's parameters were loaded somewhere at dp=1 x pp=4.
    assert {n for r in (four0, four1, four2, four3) for n in r["pp4"]["params"]} == set(params)

    # The live gather, and consolidation, give every expert by global index; Adam numbered as one device.
    names = list(build_model().state_dict())
    for name, value in params.items():
        assert torch.equal(four0["gathered"][name], value), name
        for key, expected in state[name].items():
            got = four0["gathered_state"]["state"][names.index(name)][key]
            assert torch.equal(got, expected), f"gathered {name} {key}"
    for source in (saved, tmp_path / "plain.ckpt"):
        consolidated = consolidate_checkpoint(source)
        for name, value in params.items():
            assert torch.equal(consolidated["state_dict"][name], value), f"{source.name}: {name}"
        (optimizer,) = consolidated["optimizer_states"]
        for position, name in enumerate(names):
            for key, value in state[name].items():
                assert torch.equal(optimizer["state"][position][key], value), f"{source.name}: {name} {key}"

    # The command line consolidates it too, and says the layout it was saved with.
    assert consolidate_main([str(saved), str(tmp_path / "model.ckpt")]) == 0
    assert "saved with dp=2 (ep=2) x pp=2 x tp=1" in capsys.readouterr().out
    single = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert all(torch.equal(single["state_dict"][n], v) for n, v in params.items())

    # Metadata whose expert blocks do not cover the experts once each is damaged, said as such.
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(saved, damaged)
    edit_metadata(damaged, lambda d: d["model"]["1.weight"].update(experts=[[0, 2], [1, 2]]))
    with pytest.raises(
        CheckpointError, match=r"do not cover its 4 experts once each; the checkpoint is damaged"
    ):
        consolidate_checkpoint(damaged)
