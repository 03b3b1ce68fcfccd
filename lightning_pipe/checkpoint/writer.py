"""Write a sharded checkpoint: every writing rank saves its own file, nobody gathers the model.

The protocol keeps the previous checkpoint safe and never leaves a rank hanging:

1. Global rank 0 checks that ``NAME`` is absent or something a save may replace (never a user's
   own directory), then creates a fresh temporary directory ``.NAME.tmp`` beside ``NAME``.
2. Each writing rank saves its shard there, with a CRC32 of each tensor's bytes in its records
   (:mod:`~lightning_pipe.checkpoint.integrity`); rank 0 also saves the Lightning state. A rank whose
   write fails does not raise yet: all ranks exchange their outcome (and their small tensor
   records) in one ``all_gather_object``, so every rank raises the same error together instead of
   one rank raising while the others wait in a collective until the timeout.
3. Rank 0 checks that every file is visible to it (a rank writing to a directory that is not on a
   shared filesystem would otherwise produce a checkpoint missing shards), writes the metadata last,
   then swaps the directory into place (:func:`~lightning_pipe.checkpoint.replace.replace_path`):
   ``NAME`` -> ``.NAME.old``, ``.NAME.tmp`` -> ``NAME``, then removes ``.NAME.old``. A crash at any
   point leaves either the previous checkpoint under ``NAME``, or (between the two renames) intact
   under ``.NAME.old``; never a half-written ``NAME``.
4. The outcome of step 3 is exchanged again, so that all ranks return or raise together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.checkpoint.collective import describe_failures, error_text, exchange
from lightning_pipe.checkpoint.durable import (
    disk_full_text,
    save_durably,
    sync_directory,
    write_text_durably,
)
from lightning_pipe.checkpoint.integrity import tensor_crc32
from lightning_pipe.checkpoint.metadata import (
    HOW_TO_LOAD,
    HOW_TO_LOAD_FILE,
    LIGHTNING_STATE_FILE,
    CheckpointError,
    CheckpointMetadata,
    OptimizerEntries,
    TensorEntry,
)
from lightning_pipe.checkpoint.replace import (
    check_replaceable,
    discard,
    recover_leftover,
    remove_path,
    replace_path,
)

# What rank 0 was doing when the first step failed, for the error every rank raises.
_CHECKING, _CREATING = "checking the checkpoint path", "creating the temporary directory"


@dataclass
class PartFile:
    """What one writing rank saves: its file's payload and where each value of it belongs.

    ``parts`` holds, for each record, this rank's position among the record's files (its tensor
    rank for a value split by tensor ranks, its first expert for one split by experts, 0
    otherwise), so that rank 0 can merge the records of all ranks into one file list per value.
    """

    file_name: str
    payload: dict[str, Any]
    model: dict[str, tuple[TensorEntry, int]] = field(default_factory=dict)
    optimizers: list[dict[str, dict[str, tuple[TensorEntry, int]]]] = field(default_factory=list)

    def with_checksums(self) -> PartFile:
        """These records with the CRC32 of each tensor value of the payload (the bytes this file
        will hold for it), which every read compares. The payload comes back on the CPU: a
        device tensor is copied once, for its checksum and its save alike (every read maps to the
        CPU anyway)."""

        def checked(record: tuple[TensorEntry, int], value: Any) -> tuple[TensorEntry, int]:
            entry, part = record
            crc = tensor_crc32(value) if isinstance(value, torch.Tensor) else None
            return (entry if crc is None else replace(entry, crc32=(crc,))), part

        payload = _on_cpu(self.payload)
        model = payload.get("model", {})
        states = payload.get("optimizers", [])
        return PartFile(
            self.file_name,
            payload,
            {key: checked(record, model.get(key)) for key, record in self.model.items()},
            [
                {
                    name: {k: checked(r, states[i].get(name, {}).get(k)) for k, r in entries.items()}
                    for name, entries in optimizer.items()
                }
                for i, optimizer in enumerate(self.optimizers)
            ],
        )


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor on another device copied to the CPU (dicts and lists rebuilt
    around them; CPU tensors and everything else as they are)."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _raise_if_failed(outcomes: list[tuple[str | None, Any]], path: Path, what: str) -> None:
    failures = describe_failures([error for error, _ in outcomes])
    if failures is not None:
        raise CheckpointError(
            f"Saving the checkpoint {path} failed while {what} ({failures}). Any previous "
            f"checkpoint at {path} is untouched."
        )


def _merge(
    parts: list[dict[str, tuple[TensorEntry, int]]], order: list[str] | None = None
) -> dict[str, TensorEntry]:
    """One record per key from every rank's partial records: the files sorted by part."""
    found: dict[str, list[tuple[int, TensorEntry]]] = {}
    for records in parts:
        for key, (record, part) in records.items():
            found.setdefault(key, []).append((part, record))
    keys = [k for k in order if k in found] if order is not None else sorted(found)
    keys += sorted(set(found) - set(keys))
    merged = {}
    for key in keys:
        pieces = sorted(found[key], key=lambda item: item[0])
        first = pieces[0][1]
        checksums = [r.crc32 for _, r in pieces]
        merged[key] = TensorEntry(
            files=tuple(f for _, r in pieces for f in r.files),
            shape=first.shape,
            dtype=first.dtype,
            tp_dim=first.tp_dim,
            # One per file, or none: a piece without one (not a tensor) leaves the value unchecked.
            crc32=None if any(c is None for c in checksums) else tuple(c for cs in checksums for c in cs),  # type: ignore[union-attr]
            expert_dim=first.expert_dim,
            experts=None
            if first.expert_dim is None
            else tuple(block for _, r in pieces for block in r.experts or ()),
        )
    return merged


def write_checkpoint_directory(
    path: str | Path,
    shard: PartFile | None,
    lightning_state: dict[str, Any] | None,
    metadata: CheckpointMetadata | None,
    key_order: list[str] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collective: save this rank's ``shard`` (``None`` on ranks that write nothing) into ``path``.
    Without an initialized process group the one process is rank 0 and writes everything.

    Rank 0 of ``group`` passes the ``lightning_state`` and the ``metadata`` header (layout and
    plan; its records are filled in here from every rank's shard).
    """
    path = Path(path)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0  # one process
    tmp = path.parent / f".{path.name}.tmp"

    error, step = None, _CHECKING
    if rank == 0:
        try:
            check_replaceable(path)
            step = _CREATING
            recover_leftover(path)  # a complete checkpoint a crashed save left: never delete it
            remove_path(tmp)  # what is left is an incomplete save's
            tmp.mkdir(parents=True)
        except Exception as err:  # reported to every rank below, then raised on all of them
            error = error_text(err) if step == _CHECKING else f"could not create {tmp}: {err}"
    outcomes = exchange(error, step, group)
    _raise_if_failed(outcomes, path, outcomes[0][1])

    error = None
    try:
        if shard is not None:
            shard = shard.with_checksums()
            save_durably(shard.payload, tmp / shard.file_name)
        if rank == 0:
            save_durably(lightning_state, tmp / LIGHTNING_STATE_FILE)
            write_text_durably(tmp / HOW_TO_LOAD_FILE, HOW_TO_LOAD)  # for whoever looks inside
    except Exception as err:  # reported to every rank below, then raised on all of them
        error = disk_full_text(err, tmp) or error_text(err)
    records = None if shard is None else (shard.model, shard.optimizers)
    outcomes = exchange(error, records, group)
    if any(e for e, _ in outcomes) and rank == 0:
        discard(tmp)
    _raise_if_failed(outcomes, path, "writing the shards")

    error = None
    if rank == 0:
        try:
            if metadata is None:
                raise CheckpointError("global rank 0 must pass the metadata header")
            written = [r for _, r in outcomes if r is not None]
            metadata.model = _merge([model for model, _ in written], key_order)
            count = max((len(opts) for _, opts in written), default=0)
            metadata.optimizers = [
                _merge_optimizer([opts[i] for _, opts in written if i < len(opts)]) for i in range(count)
            ]
            missing = sorted(f for f in metadata.files() if not (tmp / f).is_file())
            if missing:
                raise CheckpointError(
                    f"the files {missing} written by other ranks are not visible to rank 0 in {tmp}: the "
                    "checkpoint directory must be on a filesystem that every node shares"
                )
            metadata.write(tmp)  # last: its presence marks a complete checkpoint
            # Every rank's file is on the disk (fsync above); the names must be too before the
            # rename publishes the directory, and the rename itself after.
            sync_directory(tmp)
            replace_path(tmp, path)
            sync_directory(path.parent)
        except Exception as err:
            error = disk_full_text(err, tmp) or error_text(err)
            discard(tmp)
    _raise_if_failed(exchange(error, None, group), path, "committing the checkpoint")


def _merge_optimizer(parts: list[dict[str, dict[str, tuple[TensorEntry, int]]]]) -> OptimizerEntries:
    flat = [
        {f"{name}\0{k}": v for name, entries in part.items() for k, v in entries.items()} for part in parts
    ]
    merged: OptimizerEntries = {}
    for key, record in _merge(flat).items():
        name, state_key = key.split("\0")
        merged.setdefault(name, {})[state_key] = record
    return merged
