"""Checkpoint safety in one process: what a save may replace, aliased keys, state that cannot be cut.

What this file proves:

* ``replace_path`` replaces a file atomically, a symlink as a link (its target untouched), a
  sharded directory and an empty one; it refuses a user's own directory; when the final rename
  fails the previous checkpoint is back under its name; when only deleting the previous one fails,
  the new checkpoint is in place and a warning says where the old one is.
* ``save_atomically`` and ``consolidate_checkpoint(output=...)`` refuse a user's directory before
  reading or writing anything.
* Consolidation copies non-tensor state-dict entries (``get_extra_state``), consolidates a
  checkpoint onto its own path from the command line, and reads pickled hyper-parameters only when
  asked (``--trust-pickle``).
* Metadata that is JSON but not a metadata object, with other layout keys, or a record naming no
  file, is reported as a damaged checkpoint, not as an ``AttributeError`` or ``IndexError``.
* A key outside the pipeline layers that aliases a layer's tensor (``self.head = self.layers[-1]``)
  is saved by the stage that trains it and loaded from that stage's copy; tensor-parallel sharding
  of that layer replaces it under both names.
* Optimizer state of a tensor-parallel parameter that is neither parameter-shaped nor a scalar is
  refused at save time; a parameter-group mismatch names the fix for optimizers, not for modules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint import replace as replace_module
from lightning_pipe.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    part_file_name,
)
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.replace import check_replaceable, recover_leftover, replace_path
from lightning_pipe.checkpoint.single_file import save_atomically
from lightning_pipe.checkpoint.state import (
    load_model_part,
    load_optimizer_part,
    model_entries,
    model_part,
    optimizer_part,
)
from lightning_pipe.checkpoint.writer import PartFile, write_checkpoint_directory
from lightning_pipe.consolidate import main as consolidate_main
from lightning_pipe.partition.model import PipelinePartition, partition_model
from lightning_pipe.tensor_parallel import TensorParallelStyle, apply_plan
from tests.checkpoint_files import edit_metadata
from tests.distributed import run_distributed

LAYOUT = {"data_parallel_size": 1, "pipeline_parallel_size": 1, "tensor_parallel_size": 1}


class Hyper:
    """A hyper-parameter object that ``torch.load(weights_only=True)`` refuses."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hyper)


class WithExtraState(nn.Module):
    """A layer whose state dict holds a non-tensor entry (``get_extra_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls = 3

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "name": "counter"}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def save_module(path: Path, module: nn.Module, lightning_state: dict[str, Any]) -> None:
    """A one-process sharded checkpoint of ``module`` (one stage, one tensor rank)."""
    # No key lies in a pipeline layer here: all of them are stage 0's to save.
    plan = PipelinePartition(layer_names=("no_layer",), balance=(1,), parameter_counts=(0,))
    file = part_file_name(0, 0)
    model = model_part(module, plan, 0, 0)
    shard = PartFile(file, {"model": model, "optimizers": []}, model_entries(model, module, 1, 0, file))
    header = CheckpointMetadata(layout=dict(LAYOUT), layer_names=list(plan.layer_names), balance=[1])
    write_checkpoint_directory(path, shard, lightning_state, header)


def sharded_dir(path: Path) -> Path:
    save_module(path, nn.Linear(2, 2), {"epoch": 1})
    return path


# ----------------------------------------------------------------------------------- replace_path
def test_replace_path_replaces_a_file_atomically(tmp_path: Path) -> None:
    (tmp_path / "new").write_text("new")
    (tmp_path / "x.ckpt").write_text("old")
    replace_path(tmp_path / "new", tmp_path / "x.ckpt")
    assert (tmp_path / "x.ckpt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


def test_replace_path_replaces_a_symlink_and_leaves_its_target(tmp_path: Path) -> None:
    target = sharded_dir(tmp_path / "epoch=1.ckpt")
    (tmp_path / "last.ckpt").symlink_to(target.name, target_is_directory=True)
    new = sharded_dir(tmp_path / "new")
    replace_path(new, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and (tmp_path / "last.ckpt").is_dir()
    assert CheckpointDirectory(target).lightning_state() == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt", "last.ckpt"]


def test_replace_path_refuses_a_users_directory(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    (tmp_path / "new").write_text("new")
    with pytest.raises(
        CheckpointError, match=re.escape(f"{tmp_path / 'data'}: it is a directory that is not a")
    ):
        replace_path(tmp_path / "new", tmp_path / "data")
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"
    check_replaceable(tmp_path / "nowhere")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")


def fail_renaming(source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make renaming ``source`` (the new checkpoint) fail, as a full disk or an I/O error would."""
    real_rename = Path.rename

    def rename(self: Path, target: Any) -> Any:
        if self == source:
            raise OSError("disk full")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)


def test_replace_path_restores_the_previous_checkpoint_when_the_last_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = sharded_dir(tmp_path / "x.ckpt")
    new = sharded_dir(tmp_path / "new")
    fail_renaming(new, monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        replace_path(new, previous)
    assert CheckpointDirectory(previous).lightning_state() == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "x.ckpt"]


def test_replace_path_warns_when_only_the_old_copy_cannot_be_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    save_module(tmp_path / "new", nn.Linear(2, 2), {"epoch": 2})

    def rmtree(where: Any) -> None:
        raise OSError("permission denied")

    monkeypatch.setattr(replace_module.shutil, "rmtree", rmtree)
    with pytest.warns(UserWarning, match=r"is saved, but the previous one, moved to .*\.x\.ckpt\.old"):
        replace_path(tmp_path / "new", path)
    assert CheckpointDirectory(path).lightning_state() == {"epoch": 2}


def test_save_atomically_and_consolidate_refuse_a_users_directory_first(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not a lightning_pipe checkpoint"):
        save_atomically({"state_dict": {}}, tmp_path / "data")
    # The output is checked before the input is read: the input here does not even exist.
    with pytest.raises(CheckpointError, match="not a lightning_pipe checkpoint"):
        consolidate_checkpoint(tmp_path / "missing.ckpt", tmp_path / "data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------------- consolidation
def test_consolidate_copies_non_tensor_entries(tmp_path: Path) -> None:
    module = WithExtraState()
    save_module(tmp_path / "x.ckpt", module, {"epoch": 0})
    state = consolidate_checkpoint(tmp_path / "x.ckpt")["state_dict"]
    assert state["_extra_state"] == {"calls": 3, "name": "counter"}
    fresh = WithExtraState()
    fresh.calls = 0
    fresh.load_state_dict(state, strict=True)
    assert fresh.calls == 3 and torch.equal(fresh.linear.weight, module.linear.weight)


def test_consolidate_cli_onto_its_own_path_and_trust_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = nn.Linear(2, 2)
    save_module(tmp_path / "x.ckpt", module, {"epoch": 4, "hyper_parameters": {"h": Hyper()}})
    assert consolidate_main([str(tmp_path / "x.ckpt"), str(tmp_path / "x.ckpt")]) == 1
    assert "--trust-pickle" in capsys.readouterr().err
    assert (tmp_path / "x.ckpt").is_dir()  # untouched by the failed attempt

    assert consolidate_main([str(tmp_path / "x.ckpt"), str(tmp_path / "x.ckpt"), "--trust-pickle"]) == 0
    assert "saved with dp=1 x pp=1 x tp=1" in capsys.readouterr().out
    checkpoint = torch.load(tmp_path / "x.ckpt", weights_only=False)
    assert checkpoint["hyper_parameters"] == {"h": Hyper()} and checkpoint["epoch"] == 4
    assert torch.equal(checkpoint["state_dict"]["weight"], module.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


# -------------------------------------------------------------------------------- damaged metadata
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: [d], "not a lightning_pipe checkpoint metadata file \\(format 'list'\\)"),
        (lambda d: {**d, "layout": [1, 2]}, "is damaged: AttributeError"),
        (lambda d: {**d, "layout": {"pipeline_parallel_size": 1}}, "expected positive sizes for"),
        (lambda d: {**d, "layout": {**d["layout"], "tensor_parallel_size": 0}}, "expected positive sizes"),
    ],
    ids=["a list", "layout a list", "layout keys", "size 0"],
)
def test_metadata_of_the_wrong_shape_is_a_damaged_checkpoint(
    tmp_path: Path, change: Any, message: str
) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    metadata = path / METADATA_FILE
    metadata.write_text(json.dumps(change(json.loads(metadata.read_text()))))
    with pytest.raises(CheckpointError, match=message):
        CheckpointDirectory(path)


def test_a_record_without_files_is_a_damaged_checkpoint(tmp_path: Path) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    edit_metadata(path, lambda data: data["model"]["weight"].update(files=[]))
    with pytest.raises(CheckpointError, match="names no shard file for the model entry 'weight'"):
        CheckpointDirectory(path).model_value("weight")


# ---------------------------------------------------------------------------------- aliased keys
class AliasedHead(nn.Module):
    """Two pipeline layers; ``head`` is a second name for the last one, outside the layer list."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 2)])
        self.head = self.layers[1]


def test_a_key_aliasing_a_layer_is_saved_and_loaded_by_that_layers_stage(tmp_path: Path) -> None:
    net = AliasedHead()
    plan = partition_model(net, list(net.layers), 2)
    assert plan.aliases == (("head.weight", 1), ("head.bias", 1))
    assert [plan.stage_of_key(k) for k in net.state_dict()] == [0, 0, 1, 1, 1, 1]
    assert set(model_part(net, plan, 0, 0)) == {"layers.0.weight", "layers.0.bias"}
    assert set(model_part(net, plan, 1, 0)) == {
        "layers.1.weight",
        "layers.1.bias",
        "head.weight",
        "head.bias",
    }

    # Stage 0's copy of the last layer is stale (it never trains it); stage 1's is the trained one.
    # Each stage writes its shard file and records as a pp=2 run would; the loader is one device.
    stale, trained = AliasedHead(), AliasedHead()
    with torch.no_grad():
        trained.layers[1].weight.add_(1.0)
    path = tmp_path / "x.ckpt"
    path.mkdir()
    header = CheckpointMetadata(layout=dict(LAYOUT), layer_names=list(plan.layer_names), balance=[1, 1])
    for pp_rank, source in enumerate((stale, trained)):
        file = part_file_name(pp_rank, 0)
        model = model_part(source, plan, pp_rank, 0)
        torch.save({"model": model, "optimizers": []}, path / file)
        header.model.update(
            {key: record for key, (record, _) in model_entries(model, source, 1, 0, file).items()}
        )
    header.write(path)
    torch.save({}, path / "lightning_state.pt")
    assert header.model["head.weight"].files == ("shard-pp1-tp0.pt",)

    fresh = AliasedHead()
    one_stage = partition_model(fresh, list(fresh.layers), 1)
    fresh.load_state_dict(
        load_model_part(CheckpointDirectory(path), fresh, one_stage, 0, 1, 0, True), strict=True
    )
    assert torch.equal(fresh.head.weight, trained.layers[1].weight)
    assert torch.equal(fresh.layers[0].weight, stale.layers[0].weight)


# ----------------------------------------------------------------------------- optimizer state
def test_optimizer_state_that_cannot_be_cut_is_refused_at_save_time() -> None:
    net = nn.Sequential(nn.Linear(2, 4))
    net[0].weight.tensor_parallel_dim = 0  # type: ignore[attr-defined]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    # An Adafactor-like row factor: one value per row, not shaped like the weight.
    optimizer.state[net[0].weight]["row_factor"] = torch.ones(4)
    plan = partition_model(net, list(net), 1)
    with pytest.raises(
        CheckpointError, match=r"'row_factor' of the tensor-parallel parameter '0\.weight' has"
    ):
        optimizer_part(optimizer, net, plan, 0, 0)
    # A scalar (Adam's step) is the same on every tensor rank: saved once, no error.
    optimizer.state[net[0].weight] = {"step": torch.tensor(3.0)}
    assert set(optimizer_part(optimizer, net, plan, 0, 0)["state"]["0.weight"]) == {"step"}


def test_a_parameter_group_mismatch_names_the_optimizer_fix(tmp_path: Path) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    net = nn.Linear(2, 2)
    saved = {
        "param_names": ["weight", "bias"],
        "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}],
    }
    optimizer = torch.optim.SGD([{"params": [net.bias]}, {"params": [net.weight]}], lr=0.1)
    with pytest.raises(CheckpointError) as info:
        load_optimizer_part(CheckpointDirectory(path), 0, saved, optimizer, net, set(), 1, 0)
    message = str(info.value)
    assert "parameter group 0" in message and "configure_optimizers must put the same parameters" in message
    assert "strict_loading" not in message


def shard_aliased_worker() -> tuple[bool, str]:
    """Shard the aliased layer with a one-rank tensor group; report what ``head`` then is."""
    net = AliasedHead()
    apply_plan(net, {"layers.1": TensorParallelStyle.ROWWISE_SPLIT}, dist.group.WORLD, seed=0)
    return net.head is net.layers[1], type(net.head).__name__


@pytest.mark.distributed
def test_sharding_a_layer_also_shards_its_other_names() -> None:
    # Otherwise ``head`` would keep the full, never-trained module and save it as the head.
    assert run_distributed(shard_aliased_worker, 1, timeout=60.0) == [(True, "RowParallelLinear")]


def test_a_crash_between_the_renames_is_recovered_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The crash left the previous checkpoint only under .x.ckpt.old; the next save then fails at
    # its final rename. The previous checkpoint must be back under its own name, not deleted.
    previous = sharded_dir(tmp_path / "x.ckpt")
    previous.rename(tmp_path / ".x.ckpt.old")
    new = sharded_dir(tmp_path / "new")
    fail_renaming(new, monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        replace_path(new, tmp_path / "x.ckpt")
    assert CheckpointDirectory(tmp_path / "x.ckpt").lightning_state() == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "x.ckpt"]


@pytest.mark.parametrize(
    "failure",
    [OSError(28, "No space left on device"), RuntimeError("[enforce fail] unexpected pos 1344 vs 1238")],
    ids=["ENOSPC", "torch-short-write"],
)
def test_a_full_disk_is_reported_as_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    from lightning_pipe.checkpoint import durable
    from lightning_pipe.checkpoint.single_file import save_atomically

    target = tmp_path / "model.ckpt"
    save_atomically({"step": 1}, target)

    def full_disk(obj: Any, file: Any) -> None:
        file.write(b"partial")
        raise failure

    monkeypatch.setattr(durable.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_atomically({"step": 2}, target)
    message = str(info.value)
    assert message.startswith(f"Saving the checkpoint {target} failed: the disk or the quota holding ")
    assert "is full (" in message and "bytes free" in message
    assert (
        "Free some space or save the checkpoints elsewhere; the previous checkpoint is untouched." in message
    )
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_a_complete_checkpoint_left_by_a_crash_is_recovered_not_deleted(tmp_path: Path) -> None:
    """A crash after the new checkpoint was complete but before its rename: ``x.ckpt`` is missing,
    the newer complete copy is ``.x.ckpt.tmp`` and the previous one ``.x.ckpt.old``. The next save
    must not delete the complete ``.tmp`` (it moves it back first), and nothing complete is lost."""
    save_module(tmp_path / ".x.ckpt.tmp", nn.Linear(2, 2), {"epoch": 2})
    save_module(tmp_path / ".x.ckpt.old", nn.Linear(2, 2), {"epoch": 1})
    with pytest.warns(
        UserWarning, match=r"x\.ckpt was missing: .*left the complete checkpoint \.x\.ckpt\.tmp"
    ):
        assert recover_leftover(tmp_path / "x.ckpt") == tmp_path / ".x.ckpt.tmp"
    assert CheckpointDirectory(tmp_path / "x.ckpt").lightning_state() == {"epoch": 2}
    assert recover_leftover(tmp_path / "x.ckpt") is None  # present now: nothing to do
    # The next save replaces the recovered one as usual and clears the older leftover.
    save_module(tmp_path / "x.ckpt", nn.Linear(2, 2), {"epoch": 3})
    assert CheckpointDirectory(tmp_path / "x.ckpt").lightning_state() == {"epoch": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


def test_a_save_over_a_crashed_complete_save_keeps_it_until_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_module(tmp_path / ".x.ckpt.tmp", nn.Linear(2, 2), {"epoch": 2})  # complete, never renamed
    import lightning_pipe.checkpoint.writer as writer

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(writer, "save_durably", fail)
    with pytest.warns(UserWarning, match="was missing"), pytest.raises(CheckpointError, match="disk on fire"):
        save_module(tmp_path / "x.ckpt", nn.Linear(2, 2), {"epoch": 3})
    assert CheckpointDirectory(tmp_path / "x.ckpt").lightning_state() == {"epoch": 2}


# ------------------------------------------------------------------- completeness when consolidating
def test_consolidate_refuses_metadata_that_lost_an_entry(tmp_path: Path) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    edit_metadata(path, lambda data: data["model"].pop("bias"))
    with pytest.raises(
        CheckpointError, match=r"does not record 1 value\(s\) its shard files hold: \[\"model "
    ):
        consolidate_checkpoint(path)
    assert consolidate_main([str(path), str(tmp_path / "out.ckpt")]) == 1
    assert not (tmp_path / "out.ckpt").exists()


def test_consolidate_refuses_a_layout_missing_a_shard_file(tmp_path: Path) -> None:
    path = sharded_dir(tmp_path / "x.ckpt")
    edit_metadata(
        path, lambda data: data["layout"].update(pipeline_parallel_size=2)
    )  # the layout says two stages wrote; one file is there
    with pytest.raises(CheckpointError, match=r"writes the shard files .*'shard-pp1-tp0.pt'\] are not there"):
        consolidate_checkpoint(path)


def test_load_from_checkpoint_explains_a_directory_without_metadata(tmp_path: Path) -> None:
    from lightning_pipe import load_from_checkpoint
    from tests.lightning_models import Regressor

    path = sharded_dir(tmp_path / "x.ckpt")
    (path / METADATA_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"is a directory without {METADATA_FILE}"):
        load_from_checkpoint(Regressor, path)
