"""The sharded checkpoint format (``lightning_pipe.checkpoint``), tested in plain torch.

What this file proves:

* Two real gloo ranks each write their slice of tensor-parallel values (split along dim 0 and dim 1)
  and rank 0 the replicated ones; the reader, in another process, returns every full tensor bit for
  bit, with the records, key order, layout and Lightning state the writers gave.
* A second save to the same path replaces the directory (no stale shard from the first save), a
  save onto a single-file checkpoint replaces the file, and no ``.NAME.tmp`` / ``.NAME.old`` stays.
* A save that fails on one rank (unpicklable shard, unpicklable Lightning state, unwritable parent,
  a shard rank 0 cannot see) raises the same ``CheckpointError`` on every rank, naming the failing
  rank, without a hang; the previous checkpoint still reads back its values, and the process group
  still works for the next save.
* The reader names the problem for a missing path, a directory without metadata, a missing or
  damaged shard file, an unknown format version, damaged JSON, a record shape that disagrees with
  the stored tensor, an entry the metadata places in a file that lacks it, bytes of one tensor
  rank's slice changed (its own file's CRC32 of a value split over two files).
* ``state.py`` cuts, checks and re-numbers state exactly: ``slice_for``, ``full_shape``,
  ``check_keys``, ``slice_optimizer_state``, ``model_part``, ``optimizer_part``,
  ``load_model_part`` (into another pipeline/tensor layout) and ``load_optimizer_part``.
* ``consolidate_checkpoint`` and ``python -m lightning_pipe.consolidate`` turn a sharded checkpoint
  into one ordinary checkpoint file that ``torch.load(weights_only=True)`` and ``torch.optim`` accept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.checkpoint import consolidate_checkpoint, is_checkpoint_directory
from lightning_pipe.checkpoint.metadata import (
    HOW_TO_LOAD_FILE,
    LIGHTNING_STATE_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    TensorEntry,
    part_file_name,
)
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.state import (
    check_keys,
    full_shape,
    load_model_part,
    load_optimizer_part,
    model_part,
    optimizer_part,
    slice_for,
    slice_optimizer_state,
)
from lightning_pipe.checkpoint.writer import PartFile, write_checkpoint_directory
from lightning_pipe.partition.model import PipelinePartition
from tests.checkpoint_files import edit_metadata, flip_tensor_bytes
from tests.distributed import run_distributed

TP = 2
LAYOUT = {"data_parallel_size": 1, "pipeline_parallel_size": 1, "tensor_parallel_size": TP}
# The state dict of nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)) under tensor parallelism:
# column-parallel first layer (split along dim 0), row-parallel second (weight along dim 1, bias
# replicated).
SPLIT_DIMS: dict[str, int | None] = {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": None}
KEY_ORDER = ["1.bias", "0.weight", "1.weight", "0.bias"]  # deliberately not sorted
MAIN_SEED, FIRST_SEED = 0, 1
FAILED_SAVES = ("bad_shard", "bad_state", "invisible", "no_dir", "user_dir")
OPTIM_PARAM_GROUPS = [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]


@dataclass
class Opaque:
    """An object ``torch.load(weights_only=True)`` refuses."""

    value: int


# ------------------------------------------------------------------------------- reference values
def model_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "0.weight": torch.randn(4, 3, generator=g),
        "0.bias": torch.randn(4, generator=g),
        "1.weight": torch.randn(2, 4, generator=g),
        "1.bias": torch.randn(2, generator=g),
    }


def lightning_state(seed: int) -> dict[str, Any]:
    return {"epoch": seed, "global_step": 10 * seed, "loops": {"fit_loop": {"batches": [seed, 2]}}}


def optim_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(4, 2, generator=g),
        "b.weight": torch.randn(3, generator=g),
        "a.momentum": torch.randn(4, 2, generator=g),
        "b.momentum": torch.randn(3, generator=g),
    }


def optim_lightning_state() -> dict[str, Any]:
    return {
        "epoch": 3,
        "global_step": 12,
        "optimizer_states": [{"param_groups": OPTIM_PARAM_GROUPS, "param_names": ["a.weight", "b.weight"]}],
        "lr_schedulers": [{"last_epoch": 3}],
        "callbacks": {"cb": {"best": 1.5}},
        "hyper_parameters": {"hidden": 4},
    }


def header() -> CheckpointMetadata:
    return CheckpointMetadata(layout=dict(LAYOUT), layer_names=["0", "1"], balance=[1, 1])


def record(file: str, full: torch.Tensor, dim: int | None) -> TensorEntry:
    return TensorEntry(files=(file,), shape=tuple(full.shape), dtype="float32", tp_dim=dim)


# ------------------------------------------------------------------------ worker (runs on each rank)
def model_shard_of_rank(values: dict[str, torch.Tensor], rank: int, pp: int = 0) -> PartFile:
    """What rank ``rank`` writes: its slice of each split value, the replicated ones on rank 0."""
    file = part_file_name(pp, rank)
    payload: dict[str, torch.Tensor] = {}
    records: dict[str, tuple[TensorEntry, int]] = {}
    for key, full in values.items():
        dim = SPLIT_DIMS.get(key)
        if dim is None:
            if rank == 0:
                payload[key] = full.clone()
                records[key] = (record(file, full, None), 0)
        else:
            payload[key] = full.chunk(TP, dim)[rank].clone()
            records[key] = (record(file, full, dim), rank)
    return PartFile(file, {"model": payload, "optimizers": []}, model=records)


def optim_shard_of_rank(rank: int) -> PartFile:
    v = optim_values()
    file = part_file_name(0, rank)
    model: dict[str, torch.Tensor] = {"a.weight": v["a.weight"].chunk(TP, 0)[rank].clone()}
    records: dict[str, tuple[TensorEntry, int]] = {"a.weight": (record(file, v["a.weight"], 0), rank)}
    a_state: dict[str, Any] = {"momentum_buffer": v["a.momentum"].chunk(TP, 0)[rank].clone()}
    a_records: dict[str, tuple[TensorEntry, int]] = {
        "momentum_buffer": (record(file, v["a.momentum"], 0), rank)
    }
    optimizer: dict[str, dict[str, Any]] = {"a.weight": a_state}
    optimizer_entries = {"a.weight": a_records}
    if rank == 0:
        model["b.weight"] = v["b.weight"].clone()
        records["b.weight"] = (record(file, v["b.weight"], None), 0)
        a_state["step"] = 5  # a non-tensor value: a record without shape or dtype
        a_records["step"] = (TensorEntry(files=(file,)), 0)
        optimizer["b.weight"] = {"momentum_buffer": v["b.momentum"].clone()}
        optimizer_entries["b.weight"] = {"momentum_buffer": (record(file, v["b.momentum"], None), 0)}
    return PartFile(
        file, {"model": model, "optimizers": [optimizer]}, model=records, optimizers=[optimizer_entries]
    )


Failure = tuple[str, str, list[str]]
"""A failed save as one rank saw it: exception type, message, the temporaries left beside it."""


def attempt(fn: Callable[[], None], root: Path) -> Failure | None:
    try:
        fn()
    except Exception as err:
        leftovers = sorted(p.name for p in root.iterdir() if p.name.endswith((".tmp", ".old")))
        return type(err).__name__, str(err), leftovers
    return None


def save_scenarios(root_name: str) -> dict[str, Failure | None]:
    """Every save this file inspects, in one process group; returns how each failed save ended."""
    root = Path(root_name)
    rank = dist.get_rank()
    first = rank == 0

    def save(path: Path, shard: PartFile, state: Any, order: list[str] | None = None) -> None:
        write_checkpoint_directory(path, shard, state if first else None, header() if first else None, order)

    ckpt = root / "ckpt"
    # First save: other file names (pipeline stage 1) and an extra key, then replaced by the main one.
    first_values = {**model_values(FIRST_SEED), "2.extra": torch.ones(3)}
    save(ckpt, model_shard_of_rank(first_values, rank, pp=1), lightning_state(FIRST_SEED))
    save(ckpt, model_shard_of_rank(model_values(MAIN_SEED), rank), lightning_state(MAIN_SEED), KEY_ORDER)

    # A previous single-file checkpoint at the path.
    was_file = root / "was_file.ckpt"
    if first:
        was_file.write_bytes(b"an old single-file checkpoint")
    save(was_file, model_shard_of_rank(model_values(MAIN_SEED), rank), lightning_state(MAIN_SEED))

    # ModelCheckpoint(save_last="link") leaves a symlink: the save replaces the link, not its target.
    save(root / "target.ckpt", model_shard_of_rank(model_values(10), rank), lightning_state(10))
    if first:
        (root / "link.ckpt").symlink_to("target.ckpt", target_is_directory=True)
        (root / "empty.ckpt").mkdir()
    save(root / "link.ckpt", model_shard_of_rank(model_values(11), rank), lightning_state(11))
    save(root / "empty.ckpt", model_shard_of_rank(model_values(12), rank), lightning_state(12))

    outcomes: dict[str, Failure | None] = {}
    # The path is a user's own directory: refused before anything is written, its files untouched.
    if first:
        (root / "data").mkdir()
        (root / "data" / "keep.txt").write_text("precious")
    outcomes["user_dir"] = attempt(
        lambda: save(root / "data", model_shard_of_rank(model_values(9), rank), lightning_state(9)), root
    )
    # Rank 1's shard cannot be pickled.
    shard = model_shard_of_rank(model_values(5), rank)
    if rank == 1:
        shard.payload["model"]["bad"] = lambda: 1
    outcomes["bad_shard"] = attempt(lambda: save(ckpt, shard, lightning_state(5)), root)
    # Rank 0's Lightning state cannot be pickled.
    outcomes["bad_state"] = attempt(
        lambda: save(ckpt, model_shard_of_rank(model_values(6), rank), {"fn": lambda: 1}), root
    )
    # Rank 1 claims a file that nobody wrote: rank 0 finds it missing before committing.
    shard = model_shard_of_rank(model_values(7), rank)
    if rank == 1:
        shard.model["0.weight"] = (record("shard-pp0-tp9.pt", model_values(7)["0.weight"], 0), 1)
    outcomes["invisible"] = attempt(lambda: save(ckpt, shard, lightning_state(7)), root)
    # The parent of the checkpoint is a regular file: rank 0 cannot create the temporary directory.
    if first:
        (root / "a_file").write_text("not a directory")
    outcomes["no_dir"] = attempt(
        lambda: save(root / "a_file" / "ckpt", model_shard_of_rank(model_values(8), rank), {}), root
    )

    # The group still works after the failures.
    save(root / "optim.ckpt", optim_shard_of_rank(rank), optim_lightning_state())
    save(
        root / "custom.ckpt",
        model_shard_of_rank(model_values(MAIN_SEED), rank),
        {"hyper_parameters": {"obj": Opaque(3)}},
    )
    return outcomes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Failure | None]]]:
    root = tmp_path_factory.mktemp("sharded")
    results = run_distributed(save_scenarios, 2, str(root), timeout=60.0, pg_timeout=30.0)
    return root, results


@pytest.fixture
def damaged(saved: tuple[Path, Any], tmp_path: Path) -> Path:
    """A private copy of the main checkpoint, to damage."""
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(saved[0] / "ckpt", copy)
    return copy


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Deep equality with exact tensor values and dtypes."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: {actual} vs {expected}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def read_all(path: Path) -> dict[str, Any]:
    reader = CheckpointDirectory(path)
    values = {key: reader.model_value(key) for key in reader.metadata.model}
    reader.lightning_state()
    return values


# ------------------------------------------------------------------------------- writing, 2 ranks
@pytest.mark.distributed
def test_reader_returns_the_full_tensors_two_ranks_wrote(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "ckpt")
    expected = model_values(MAIN_SEED)
    assert list(reader.metadata.model) == KEY_ORDER
    for key, full in expected.items():
        assert_same(reader.model_value(key), full, key)
    tp_files = (part_file_name(0, 0), part_file_name(0, 1))
    assert reader.metadata.model["0.weight"] == TensorEntry(tp_files, (4, 3), "float32", 0)
    assert reader.metadata.model["1.weight"] == TensorEntry(tp_files, (2, 4), "float32", 1)
    assert reader.metadata.model["1.bias"] == TensorEntry((part_file_name(0, 0),), (2,), "float32", None)
    assert reader.metadata.layout == LAYOUT
    assert (reader.metadata.layer_names, reader.metadata.balance) == (["0", "1"], [1, 1])
    assert reader.metadata.optimizers == []
    assert_same(reader.lightning_state(), lightning_state(MAIN_SEED))
    assert is_checkpoint_directory(saved[0] / "ckpt")


@pytest.mark.distributed
def test_each_shard_file_holds_only_its_own_slice(saved: tuple[Path, Any]) -> None:
    full = model_values(MAIN_SEED)
    for rank in range(TP):
        payload = torch.load(saved[0] / "ckpt" / part_file_name(0, rank), weights_only=True)
        rows = slice(2 * rank, 2 * rank + 2)
        expected = {
            "0.weight": full["0.weight"][rows],
            "0.bias": full["0.bias"][rows],
            "1.weight": full["1.weight"][:, rows],
        }
        if rank == 0:
            expected["1.bias"] = full["1.bias"]
        assert_same(payload, {"model": expected, "optimizers": []}, f"rank {rank}")


@pytest.mark.distributed
def test_second_save_replaces_the_directory_and_leaves_no_temporaries(saved: tuple[Path, Any]) -> None:
    root = saved[0]
    expected_files = {
        METADATA_FILE, LIGHTNING_STATE_FILE, HOW_TO_LOAD_FILE, part_file_name(0, 0), part_file_name(0, 1)
    }  # fmt: skip
    assert {p.name for p in (root / "ckpt").iterdir()} == expected_files  # no shard-pp1-* of the first
    assert "2.extra" not in CheckpointDirectory(root / "ckpt").metadata.model
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["a_file", "ckpt", "custom.ckpt", "data", "empty.ckpt", "link.ckpt", "optim.ckpt", "target.ckpt",
         "was_file.ckpt"]
    )  # fmt: skip


@pytest.mark.distributed
def test_save_over_a_symlink_replaces_the_link_not_its_target(saved: tuple[Path, Any]) -> None:
    root = saved[0]
    assert not (root / "link.ckpt").is_symlink() and (root / "link.ckpt").is_dir()
    assert_same(read_all(root / "link.ckpt"), model_values(11))
    assert_same(read_all(root / "target.ckpt"), model_values(10))
    assert_same(read_all(root / "empty.ckpt"), model_values(12))


@pytest.mark.distributed
def test_save_onto_a_users_directory_is_refused_and_leaves_it_alone(saved: tuple[Path, Any]) -> None:
    data = saved[0] / "data"
    assert [p.name for p in data.iterdir()] == ["keep.txt"]
    assert (data / "keep.txt").read_text() == "precious"
    _, message, _ = saved[1][1]["user_dir"]  # type: ignore[misc]
    assert "Choose another checkpoint path" in message, message


@pytest.mark.distributed
def test_save_over_a_single_file_checkpoint_replaces_it(saved: tuple[Path, Any]) -> None:
    path = saved[0] / "was_file.ckpt"
    assert path.is_dir()
    assert_same(read_all(path), model_values(MAIN_SEED))


FAILURES = {
    "bad_shard": (1, "while writing the shards", "pickle"),
    "bad_state": (0, "while writing the shards", "pickle"),
    "invisible": (0, "while committing the checkpoint", "shard-pp0-tp9.pt"),
    "no_dir": (0, "while creating the temporary directory", "could not create"),
    "user_dir": (0, "while checking the checkpoint path", "is a directory that is not a lightning_pipe"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", FAILED_SAVES)
def test_failed_save_raises_on_every_rank_and_keeps_the_previous_checkpoint(
    saved: tuple[Path, Any], scenario: str
) -> None:
    root, results = saved
    failing, stage, detail = FAILURES[scenario]
    outcomes = [rank_results[scenario] for rank_results in results]
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} returned from a failed save"
        kind, message, _ = outcome
        assert kind == "CheckpointError", message
        assert stage in message and detail in message, message
        assert f"rank {failing}:" in message and f"rank {1 - failing}:" not in message, message
    assert outcomes[0][:2] == outcomes[1][:2]  # type: ignore[index]  # the same error on both ranks
    # Rank 0 removed the temporary directory before raising (rank 1 may have looked too early).
    assert outcomes[0][2] == []  # type: ignore[index]
    # The previous checkpoint is intact.
    assert_same(read_all(root / "ckpt"), model_values(MAIN_SEED))
    assert_same(CheckpointDirectory(root / "ckpt").lightning_state(), lightning_state(MAIN_SEED))
    assert not [p.name for p in root.iterdir() if p.name.endswith((".tmp", ".old"))]
    assert not (root / "a_file" / "ckpt").exists() and (root / "a_file").is_file()


# ------------------------------------------------------------------------------------ reading errors
def test_reader_rejects_a_missing_path_and_a_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointDirectory(tmp_path / "nowhere")
    (tmp_path / "single.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        CheckpointDirectory(tmp_path / "single.ckpt")


def drop_metadata(path: Path) -> None:
    (path / METADATA_FILE).unlink()


def drop_shard(path: Path) -> None:
    (path / part_file_name(0, 1)).unlink()


def truncate_shard(path: Path) -> None:
    file = path / part_file_name(0, 1)
    with file.open("r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def garble_shard(path: Path) -> None:
    (path / part_file_name(0, 1)).write_bytes(b"not a torch file" * 64)


def future_version(path: Path) -> None:
    edit_metadata(path, lambda d: d.update(version=99))


def other_format(path: Path) -> None:
    edit_metadata(path, lambda d: d.update(format="somebody.else"))


def broken_json(path: Path) -> None:
    (path / METADATA_FILE).write_text('{"format": ')


def no_layout(path: Path) -> None:
    edit_metadata(path, lambda d: d.pop("layout"))


def wrong_shape(path: Path) -> None:
    edit_metadata(path, lambda d: d["model"]["0.weight"].update(shape=[5, 3]))


def wrong_split_dim(path: Path) -> None:
    edit_metadata(path, lambda d: d["model"]["0.weight"].update(tp_dim=1))  # cat gives (2, 6)


def phantom_entry(path: Path) -> None:
    entry = {"files": [part_file_name(0, 0)], "shape": [1], "dtype": "float32", "tp_dim": None}
    edit_metadata(path, lambda d: d["model"].update(ghost=entry))


def no_lightning_state(path: Path) -> None:
    (path / LIGHTNING_STATE_FILE).unlink()


def flipped_slice(path: Path) -> None:
    """4 bytes of tensor rank 1's slice of a split weight XOR-ed: its file's (second) checksum."""
    flip_tensor_bytes(path / part_file_name(0, 1), ("model", "0.weight"), count=4)


DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "no metadata": (drop_metadata, "not a complete lightning_pipe checkpoint"),
    "missing shard": (drop_shard, r"is incomplete: .*shard-pp0-tp1\.pt"),
    "truncated shard": (truncate_shard, r"shard file .*shard-pp0-tp1\.pt cannot be read"),
    "garbled shard": (garble_shard, r"shard file .*shard-pp0-tp1\.pt cannot be read"),
    "future version": (future_version, "format version 99; this lightning_pipe reads version 1"),
    "other format": (other_format, "not a lightning_pipe checkpoint metadata file"),
    "broken json": (broken_json, "not valid JSON"),
    "no layout": (
        no_layout,
        r"pipe_tp_metadata\.json is damaged: it has no 'layout' entry\. Use an earlier checkpoint\.",
    ),
    "wrong shape": (wrong_shape, r"'0\.weight' in .* is \(4, 3\), but the metadata records \(5, 3\)"),
    "wrong split dim": (wrong_split_dim, r"'0\.weight' in .* is \(2, 6\), but the metadata records \(4, 3\)"),
    "phantom entry": (phantom_entry, r"shard-pp0-tp0\.pt does not hold the model entry 'ghost'"),
    "no lightning state": (no_lightning_state, "has no lightning_state.pt"),
    "flipped slice": (
        flipped_slice,
        r"shard-pp0-tp1\.pt is damaged: the bytes of the model entry '0\.weight' in it do not match",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("damage", DAMAGES)
def test_reader_names_what_is_wrong_with_a_damaged_checkpoint(damaged: Path, damage: str) -> None:
    change, message = DAMAGES[damage]
    change(damaged)
    with pytest.raises(CheckpointError, match=message):
        read_all(damaged)


@pytest.mark.distributed
def test_lightning_state_with_objects_needs_weights_only_false(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "custom.ckpt")
    with pytest.raises(CheckpointError, match=r"weights_only=True loading refuses"):
        reader.lightning_state()
    assert reader.lightning_state(weights_only=False) == {"hyper_parameters": {"obj": Opaque(3)}}
    assert_same(reader.model_value("1.weight"), model_values(MAIN_SEED)["1.weight"])


# --------------------------------------------------------------------------------- state.py, in-process
def marked(shape: tuple[int, ...], dim: int | None) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape))
    if dim is not None:
        param.tensor_parallel_dim = dim  # type: ignore[attr-defined]
    return param


def test_shard_of_cuts_a_full_value_along_the_marked_dim() -> None:
    full = torch.arange(24.0).reshape(4, 6)
    by_rows = slice_for(full, marked((2, 6), 0), 2, 1)
    assert_same(by_rows, full[2:4])
    by_cols = slice_for(full, marked((4, 2), 1), 3, 2)
    assert_same(by_cols, full[:, 4:6])
    assert by_cols.is_contiguous()
    assert by_cols.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()


def test_shard_of_copies_local_and_replicated_values() -> None:
    local = torch.arange(12.0).reshape(2, 6)
    out = slice_for(local, marked((2, 6), 0), 2, 1)
    assert_same(out, local)
    assert out.data_ptr() != local.data_ptr()
    replicated = torch.arange(5.0)
    out = slice_for(replicated, marked((5,), None), 2, 1)
    assert_same(out, replicated)
    assert out.data_ptr() != replicated.data_ptr()
    assert slice_for(7, marked((2, 6), 0), 2, 1) == 7
    assert_same(slice_for(torch.tensor(3.0), None, 2, 1), torch.tensor(3.0))


def test_shard_of_passes_a_scalar_step_of_a_tensor_parallel_param_through() -> None:
    step = torch.tensor(3.0)
    out = slice_for(step, marked((2, 6), 0), 2, 1)
    assert_same(out, step)


def test_full_shape() -> None:
    assert full_shape(marked((4, 2), 1), 3) == (4, 6)
    assert full_shape(marked((2, 6), 0), 2) == (4, 6)
    assert full_shape(marked((2, 6), None), 2) == (2, 6)


def test_check_keys_lists_missing_and_unexpected_keys() -> None:
    check_keys(["b", "a"], ["a", "b"], "x")  # order does not matter
    with pytest.raises(CheckpointError) as info:
        check_keys(["a", "z", "y"], ["a", "b", "c"], "The checkpoint C")
    message = str(info.value)
    assert message.startswith("The checkpoint C does not match")
    assert "missing from the checkpoint: ['b', 'c']" in message
    assert "in the checkpoint but not in the model: ['y', 'z']" in message
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \[.*'k7'\] and 2 more") as info:
        check_keys([], [f"k{i}" for i in range(10)], "w")
    assert "in the checkpoint but not in the model" not in str(info.value)


def test_slice_optimizer_state_keeps_owned_params_and_cuts_their_state() -> None:
    sharded, replicated, other = marked((2, 3), 0), marked((3,), None), marked((2, 3), 0)
    full = torch.arange(12.0).reshape(4, 3)
    state: dict[int, dict[str, Any]] = {
        0: {"momentum_buffer": full, "count": 4},
        1: {"momentum_buffer": torch.arange(3.0)},
        2: {"momentum_buffer": full},
    }
    out = slice_optimizer_state(state, [sharded, replicated, other], {id(sharded), id(replicated)}, 2, 1)
    assert_same(
        out, {0: {"momentum_buffer": full[2:4], "count": 4}, 1: {"momentum_buffer": torch.arange(3.0)}}
    )
    local = slice_optimizer_state({0: {"momentum_buffer": full[:2]}}, [sharded], {id(sharded)}, 2, 0)
    assert_same(local, {0: {"momentum_buffer": full[:2]}})
    with pytest.raises(CheckpointError, match=r"'momentum_buffer' of parameter 0 has shape \[5, 3\]"):
        slice_optimizer_state({0: {"momentum_buffer": torch.zeros(5, 3)}}, [sharded], {id(sharded)}, 2, 0)


def test_slice_optimizer_state_keeps_the_step_of_a_tensor_parallel_param() -> None:
    param = marked((2, 3), 0)
    state = {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(4, 3)}}
    out = slice_optimizer_state(state, [param], {id(param)}, 2, 1)
    assert_same(out, {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(2, 3)}})


def mark_layers(layers: nn.Sequential) -> None:
    """Mark the parameters of ``nn.Sequential(Linear, Linear)`` as the tensor-parallel layers do."""
    for name, param in layers.named_parameters():
        dim = SPLIT_DIMS[name]
        if dim is not None:
            param.tensor_parallel_dim = dim  # type: ignore[attr-defined]


class Net(nn.Module):
    """Two pipeline layers and a parameter outside them (saved by stage 0, held by every stage)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(3, 4 // tp), nn.Linear(4 // tp, 2))
        self.scale = nn.Parameter(torch.ones(1))
        if tp > 1:
            mark_layers(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


NET_PLAN = PipelinePartition(layer_names=("layers.0", "layers.1"), balance=(1, 1), parameter_counts=(8, 6))


def test_model_shard_takes_the_stage_keys_and_on_tensor_rank_1_only_split_ones() -> None:
    net = Net(tp=2)
    state = net.state_dict()
    assert_same(
        model_part(net, NET_PLAN, 0, 0), {k: state[k] for k in ("layers.0.weight", "layers.0.bias", "scale")}
    )
    assert_same(model_part(net, NET_PLAN, 0, 1), {k: state[k] for k in ("layers.0.weight", "layers.0.bias")})
    assert_same(model_part(net, NET_PLAN, 1, 0), {k: state[k] for k in ("layers.1.weight", "layers.1.bias")})
    assert_same(model_part(net, NET_PLAN, 1, 1), {"layers.1.weight": state["layers.1.weight"]})


def test_optimizer_shard_names_state_by_parameter() -> None:
    net = Net(tp=2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    buffers = {name: optimizer.state[p]["momentum_buffer"] for name, p in net.named_parameters()}
    # A module's own parameters come before its children's in named_parameters().
    names = ["scale", "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    rank0 = optimizer_part(optimizer, net, NET_PLAN, 0, 0)
    assert rank0["param_names"] == names
    assert rank0["param_groups"] == optimizer.state_dict()["param_groups"]
    assert_same(rank0["state"], {n: {"momentum_buffer": buffers[n]} for n in names[:3]})
    rank1 = optimizer_part(optimizer, net, NET_PLAN, 1, 1)
    assert_same(rank1["state"], {"layers.1.weight": {"momentum_buffer": buffers["layers.1.weight"]}})


def sequential(tp: int) -> nn.Sequential:
    """``nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))`` as tensor rank of ``tp`` holds it."""
    net = nn.Sequential(nn.Linear(3, 4 // tp), nn.Linear(4 // tp, 2))
    if tp > 1:
        mark_layers(net)
    return net


@pytest.mark.distributed
def test_load_model_shard_recuts_for_another_layout(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "ckpt")  # saved with pp=1, tp=2
    full = model_values(MAIN_SEED)
    one_stage = PipelinePartition(layer_names=("0", "1"), balance=(2,), parameter_counts=(16, 10))
    assert_same(load_model_part(reader, sequential(1), one_stage, 0, 1, 0, strict=True), full)
    two_stages = PipelinePartition(layer_names=("0", "1"), balance=(1, 1), parameter_counts=(16, 10))
    loaded = load_model_part(reader, sequential(2), two_stages, 1, 2, 1, strict=True)
    assert_same(loaded, {"1.weight": full["1.weight"][:, 2:4], "1.bias": full["1.bias"]})
    loaded = load_model_part(reader, sequential(2), two_stages, 0, 2, 0, strict=True)
    assert_same(loaded, {"0.weight": full["0.weight"][:2], "0.bias": full["0.bias"][:2]})
    net = sequential(2)
    net.load_state_dict({**net.state_dict(), **loaded})  # the cut shapes fit the module


@pytest.mark.distributed
def test_load_model_shard_reports_keys_and_shapes(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "ckpt")
    plan = PipelinePartition(layer_names=("0", "1", "2"), balance=(3,), parameter_counts=(16, 10, 6))
    bigger = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 3))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['2\.weight', '2\.bias'\]"):
        load_model_part(reader, bigger, plan, 0, 1, 0, strict=True)
    loaded = load_model_part(reader, bigger, plan, 0, 1, 0, strict=False)
    assert set(loaded) == set(SPLIT_DIMS)
    wide = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match=r"0\.weight: saved \[4, 3\], model \[5, 3\]"):
        load_model_part(reader, wide, plan, 0, 1, 0, strict=True)


class Holder(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class OptimModule(nn.Module):
    """Parameters named ``a.weight`` (split along dim 0 when ``tp > 1``) and ``b.weight``."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.a = Holder(marked((4 // tp, 2), 0 if tp > 1 else None))
        self.b = Holder(marked((3,), None))


@pytest.mark.distributed
def test_load_optimizer_shard_renumbers_and_cuts_for_the_tensor_rank(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "optim.ckpt")
    saved_state = reader.lightning_state()["optimizer_states"][0]
    v = optim_values()
    module = OptimModule(tp=2)
    # The optimizer lists the parameters in another order than the saver: state follows the names.
    optimizer = torch.optim.SGD([module.b.weight, module.a.weight], lr=1.0, momentum=0.0)
    owned = {id(module.a.weight), id(module.b.weight)}
    out = load_optimizer_part(reader, 0, saved_state, optimizer, module, owned, 2, 1)
    expected_state = {
        0: {"momentum_buffer": v["b.momentum"]},
        1: {"momentum_buffer": v["a.momentum"][2:4], "step": 5},
    }
    assert_same(
        out, {"state": expected_state, "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]}
    )
    optimizer.load_state_dict(out)
    assert_same(optimizer.state[module.a.weight]["momentum_buffer"], v["a.momentum"][2:4])
    assert optimizer.param_groups[0]["lr"] == 0.1
    only_b = load_optimizer_part(reader, 0, saved_state, optimizer, module, {id(module.b.weight)}, 2, 0)
    assert_same(only_b["state"], {0: {"momentum_buffer": v["b.momentum"]}})


@pytest.mark.distributed
def test_load_optimizer_shard_rejects_another_optimizer(saved: tuple[Path, Any]) -> None:
    reader = CheckpointDirectory(saved[0] / "optim.ckpt")
    saved_state = reader.lightning_state()["optimizer_states"][0]
    module = OptimModule(tp=1)
    two_groups = torch.optim.SGD([{"params": [module.a.weight]}, {"params": [module.b.weight]}], lr=1.0)
    with pytest.raises(CheckpointError, match="has 1 parameter groups, the model's optimizer has 2"):
        load_optimizer_part(reader, 0, saved_state, two_groups, module, set(), 1, 0)
    only_a = torch.optim.SGD([module.a.weight], lr=1.0)
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model: \['b\.weight'\]"):
        load_optimizer_part(reader, 0, saved_state, only_a, module, set(), 1, 0)


# ------------------------------------------------------------------------------------ consolidation
def expected_consolidated() -> dict[str, Any]:
    v = optim_values()
    state = optim_lightning_state()
    state["state_dict"] = {"a.weight": v["a.weight"], "b.weight": v["b.weight"]}
    state["optimizer_states"] = [
        {
            "state": {
                0: {"momentum_buffer": v["a.momentum"], "step": 5},
                1: {"momentum_buffer": v["b.momentum"]},
            },
            "param_groups": OPTIM_PARAM_GROUPS,
        }
    ]
    return state


@pytest.mark.distributed
def test_consolidate_writes_an_ordinary_checkpoint(saved: tuple[Path, Any], tmp_path: Path) -> None:
    output = tmp_path / "out" / "model.ckpt"
    returned = consolidate_checkpoint(saved[0] / "optim.ckpt", output)
    written = torch.load(output, weights_only=True)
    assert_same(written, expected_consolidated())
    assert_same(returned, expected_consolidated())
    assert "param_names" not in written["optimizer_states"][0]
    # torch.optim accepts it as it is.
    module = OptimModule(tp=1)
    optimizer = torch.optim.SGD([module.a.weight, module.b.weight], lr=1.0, momentum=0.5)
    optimizer.load_state_dict(written["optimizer_states"][0])
    assert_same(optimizer.state[module.a.weight]["momentum_buffer"], optim_values()["a.momentum"])
    assert [p.name for p in output.parent.iterdir()] == ["model.ckpt"]


@pytest.mark.distributed
def test_consolidate_weights_only_and_over_a_sharded_directory(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    output = tmp_path / "model.ckpt"
    shutil.copytree(saved[0] / "ckpt", output)  # a sharded checkpoint already at the output path
    consolidate_checkpoint(saved[0] / "optim.ckpt", output, weights_only=True)
    assert output.is_file()
    written = torch.load(output, weights_only=True)
    expected = expected_consolidated()
    for key in ("optimizer_states", "lr_schedulers", "callbacks"):
        expected.pop(key)
    assert_same(written, expected)
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]


@pytest.mark.distributed
def test_consolidate_cli(saved: tuple[Path, Any], tmp_path: Path) -> None:
    def cli(*args: str | Path) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "lightning_pipe.consolidate", *map(str, args)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    (tmp_path / "empty_dir").mkdir()
    good = cli(saved[0] / "optim.ckpt", tmp_path / "cli.ckpt")
    bad = cli(tmp_path / "empty_dir", tmp_path / "bad.ckpt")  # both at once: each start imports torch
    out, err = good.communicate(timeout=60)
    assert good.returncode == 0, err
    assert "2 state-dict entries" in out and "1 optimizer state(s)" in out, out
    assert_same(torch.load(tmp_path / "cli.ckpt", weights_only=True), expected_consolidated())
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1, (out, err)
    assert err.startswith("error:") and "not a complete lightning_pipe checkpoint" in err, err
    assert not (tmp_path / "bad.ckpt").exists()
