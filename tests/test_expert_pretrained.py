"""Pretrained weights of a meta-built mixture-of-experts model: each rank reads its experts only.

A rank holding a block of a layer's stacked experts (parameters marked with an
:class:`~lightning_pipe.experts.shard.ExpertShard`, expert dim 0, as Hugging Face's fused
``gate_up_proj`` / ``down_proj``) materialises that block from the full tensors in the weight
files: from a safetensors file by a slice of the stored tensor (the full tensor is never read),
from a ``torch.save``-d state dict by a cut. Both ways the block is built, as with an expert
module cut on the meta device that remembers its full source (how an expert-parallel plan cuts
it) and as with a block marked directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_pipe.construction.materialize import materialize
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.experts import ExpertShard, mark_expert_shard
from lightning_pipe.tensor_parallel.sources import record_source

NUM_EXPERTS, FIRST, LOCAL = 4, 2, 2
EXPERT_KEYS = ("1.weight", "1.bias")


class Experts(nn.Module):
    def __init__(self, experts: int = NUM_EXPERTS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, 3, 5))
        self.bias = nn.Parameter(torch.empty(experts, 3))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        nn.init.normal_(self.bias)


def _full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 5), Experts())
    return {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def _cut(full: nn.Module) -> nn.Module:
    """``full``'s block of experts ``[FIRST, FIRST + LOCAL)``, marked (an expert plan's cut)."""
    block = Experts(LOCAL).to(full.weight.device)
    for name in ("weight", "bias"):
        value = getattr(full, name).detach()[FIRST : FIRST + LOCAL]
        param = nn.Parameter(value.clone() if not value.is_meta else torch.empty_like(value))
        mark_expert_shard(param, ExpertShard(NUM_EXPERTS, FIRST, LOCAL))
        setattr(block, name, param)
    return block


def _meta_model(with_source: bool) -> nn.Sequential:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 5), Experts())
    full = model[1]
    model[1] = _cut(full)
    if with_source:
        record_source(model[1], full, _cut)
    return model


class _Reads:
    """Counts the full tensors a safetensors handle hands out, by key."""

    def __init__(self, handle: Any, seen: list[str]) -> None:
        self._handle, self._seen = handle, seen

    def get_tensor(self, key: str) -> torch.Tensor:
        self._seen.append(key)
        return self._handle.get_tensor(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("with_source", [True, False], ids=["cut-with-source", "marked-block"])
def test_a_rank_materialises_its_block_of_experts_from_the_full_files(
    tmp_path: Path, fmt: str, with_source: bool
) -> None:
    state = _full_state()
    path = tmp_path / ("model.safetensors" if fmt == "safetensors" else "model.pt")
    if fmt == "safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    weights = WeightFiles(path)
    full_reads: list[str] = []
    if fmt == "safetensors":
        opened = weights._open(path.name)
        weights._files[path.name] = _Reads(opened, full_reads)
    model = _meta_model(with_source)
    materialize(model, torch.device("cpu"), seed=0, skip=set(), weights=weights)
    got = model.state_dict()
    for key, value in state.items():
        expected = value[FIRST : FIRST + LOCAL] if key in EXPERT_KEYS else value
        assert torch.equal(got[key], expected), key
    assert model[1].weight.expert_shard == ExpertShard(NUM_EXPERTS, FIRST, LOCAL)  # type: ignore[attr-defined]
    if fmt == "safetensors":  # the experts were read as their block, never whole
        assert sorted(full_reads) == ["0.bias", "0.weight"]
