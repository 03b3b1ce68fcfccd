"""Damaged bytes in a sharded checkpoint are found on every read, in one process.

What this file proves:

* A save records a CRC32 per tensor and per shard file (model and optimizer state), and a clean
  checkpoint reads back bit for bit.
* 48 bytes XOR-ed inside one tensor's data (the zip structure intact, so ``torch.load`` loads it
  without a word) fail the reader, ``consolidate_checkpoint``, ``python -m
  lightning_pipe.consolidate`` (also ``--to-huggingface``) and, for a weight,
  ``lightning_pipe.load_from_checkpoint``, with a message naming the shard file and the tensor, for
  a model weight and an optimizer state.
* A checkpoint written before the checksums were recorded still loads, and its files are then
  checked against their zip entries' CRC32, which names the damaged entry.
* A damaged pickle in a shard file and a damaged ``lightning_state.pt`` are named by their entry.
* Metadata that places a value in a file that lacks it, or records a checksum count other than its
  file count, is a damaged checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_pipe
from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint.metadata import (
    LIGHTNING_STATE_FILE,
    CheckpointError,
    CheckpointMetadata,
    TensorEntry,
    part_file_name,
)
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.state import model_entries, model_part, optimizer_entries, optimizer_part
from lightning_pipe.checkpoint.writer import PartFile, write_checkpoint_directory
from lightning_pipe.consolidate import main as consolidate_main
from lightning_pipe.partition.model import PipelinePartition
from tests.checkpoint_files import drop_checksums, edit_metadata, flip_entry, flip_tensor_bytes
from tests.lightning_models import Regressor

LAYOUT = {"data_parallel_size": 1, "pipeline_parallel_size": 1, "tensor_parallel_size": 1}
SHARD = part_file_name(0, 0)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A layer and its SGD optimizer after one step (momentum buffers hold values)."""
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    return module, optimizer


def save(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A one-process sharded checkpoint of :func:`trained`'s layer and optimizer."""
    module, optimizer = trained()
    plan = PipelinePartition(layer_names=("no_layer",), balance=(1,), parameter_counts=(0,))
    model = model_part(module, plan, 0, 0)
    opt = optimizer_part(optimizer, module, plan, 0, 0)
    shard = PartFile(
        SHARD,
        {"model": model, "optimizers": [opt["state"]]},
        model_entries(model, module, 1, 0, SHARD),
        [optimizer_entries(opt["state"], module, 1, 0, SHARD)],
    )
    state = {
        "epoch": 1,
        "optimizer_states": [{k: v for k, v in opt.items() if k != "state"}],
    }
    header = CheckpointMetadata(layout=dict(LAYOUT), layer_names=list(plan.layer_names), balance=[1])
    write_checkpoint_directory(path, shard, state, header)
    return module, optimizer


def test_a_save_records_a_crc32_per_tensor_and_reads_back_exactly(tmp_path: Path) -> None:
    module, optimizer = save(tmp_path / "x.ckpt")
    metadata = CheckpointMetadata.read(tmp_path / "x.ckpt")
    assert all(r.crc32 is not None and len(r.crc32) == 1 for r in metadata.model.values())
    momentum = metadata.optimizers[0]["weight"]["momentum_buffer"]
    assert momentum.crc32 is not None and len(momentum.crc32) == 1
    checkpoint = consolidate_checkpoint(tmp_path / "x.ckpt")
    assert torch.equal(checkpoint["state_dict"]["weight"], module.weight)
    buffer = optimizer.state[module.weight]["momentum_buffer"]
    assert torch.equal(checkpoint["optimizer_states"][0]["state"][0]["momentum_buffer"], buffer)


FLIPS = {
    "model weight": (("model", "weight"), r"the model entry 'weight'"),
    "optimizer state": (
        ("optimizers", 0, "weight", "momentum_buffer"),
        r"optimizer 0's 'momentum_buffer' for 'weight'",
    ),
}


@pytest.mark.parametrize("flip", FLIPS)
def test_a_flipped_tensor_fails_every_read_naming_the_file_and_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flip: str
) -> None:
    where, what = FLIPS[flip]
    path = tmp_path / "x.ckpt"
    save(path)
    flip_tensor_bytes(path / SHARD, where, count=48)
    message = rf"{SHARD} is damaged: the bytes of {what} in it do not match the CRC32 recorded"
    with pytest.raises(CheckpointError, match=message) as info:
        consolidate_checkpoint(path)
    assert "Use an earlier checkpoint" in str(info.value)
    if where[0] == "model":  # loading weights (what a resume at any layout reads through too)
        with pytest.raises(CheckpointError, match=message):
            lightning_pipe.load_from_checkpoint(Regressor, path)
        with pytest.raises(CheckpointError, match=message):
            CheckpointDirectory(path).model_value("weight")
    # An export reads the weights only.
    for extra in ([], ["--to-huggingface"]) if where[0] == "model" else ([],):
        capsys.readouterr()
        assert consolidate_main([str(path), str(tmp_path / "out"), *extra]) == 1
        assert f"{SHARD} is damaged: the bytes of" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_checksums_still_loads_and_its_zip_crc_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    module, _ = save(path)
    drop_checksums(path)  # as lightning_pipe wrote them before it recorded checksums
    assert all(r.crc32 is None for r in CheckpointMetadata.read(path).model.values())
    assert torch.equal(consolidate_checkpoint(path)["state_dict"]["weight"], module.weight)
    entry = flip_tensor_bytes(path / SHARD, ("model", "weight"), count=48)
    with pytest.raises(CheckpointError, match=rf"{SHARD} is damaged: its entry '{entry}' does not match"):
        consolidate_checkpoint(path)


@pytest.mark.parametrize("file", [SHARD, LIGHTNING_STATE_FILE])
def test_a_damaged_pickle_is_named_by_its_entry(tmp_path: Path, file: str) -> None:
    path = tmp_path / "x.ckpt"
    save(path)
    entry = flip_entry(path / file, "/data.pkl")
    with pytest.raises(CheckpointError, match=rf"{file} is damaged: its entry '{entry}' does not match"):
        consolidate_checkpoint(path)


def test_metadata_placing_a_value_where_it_is_not_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    save(path)
    ghost = {"files": [SHARD], "shape": [1], "dtype": "float32", "tp_dim": None}
    edit_metadata(path, lambda data: data["model"].update(ghost=ghost))
    with pytest.raises(CheckpointError, match=r"is damaged: its metadata .* places 1 value\(s\) in shard"):
        consolidate_checkpoint(path)


def test_a_checksum_count_other_than_the_file_count_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    save(path)
    edit_metadata(path, lambda data: data["model"]["weight"].update(crc32=[1, 2]))
    with pytest.raises(CheckpointError, match=r"records 2 checksums for the model entry 'weight'"):
        consolidate_checkpoint(path)


def test_checksumming_a_cpu_payload_copies_no_tensor() -> None:
    """On the CPU the payload saved is the one checksummed, tensor for tensor (a device tensor is
    copied to the CPU once, for both: not testable without a device)."""
    weight, moment = torch.randn(3, 2), torch.randn(3, 2).t()  # a view with other strides too
    entry = TensorEntry(files=["f.pt"], shape=[3, 2], dtype="float32", tp_dim=None)
    moment_entry = TensorEntry(files=["f.pt"], shape=[2, 3], dtype="float32", tp_dim=None)
    part = PartFile(
        "f.pt",
        {"model": {"w": weight}, "optimizers": [{"w": {"exp_avg": moment}}]},
        {"w": (entry, 0)},
        [{"w": {"exp_avg": (moment_entry, 0)}}],
    ).with_checksums()
    assert part.payload["model"]["w"] is weight
    assert part.payload["optimizers"][0]["w"]["exp_avg"] is moment
    assert part.model["w"][0].crc32 is not None and part.optimizers[0]["w"]["exp_avg"][0].crc32 is not None
