"""Read values out of a sharded checkpoint, whole, whatever layout wrote it.

:class:`CheckpointDirectory` returns each value as the full (unsharded) tensor: the shards listed by
its record, concatenated along the saved ``tp_dim`` (or, for a value split by experts, its expert
blocks along ``expert_dim``, or only the blocks holding the experts asked for). Callers then cut the
slice their own layout needs. Shard files are opened once each with ``mmap=True``, so a rank that
needs a few of a file's tensors reads those pages, not the file, and always with
``weights_only=True``: a shard file holds nothing but tensors, strings and numbers.

Every read is checked (:mod:`~lightning_pipe.checkpoint.integrity`): each value's bytes against
the CRC32 its record holds, each opened file's pickle against its zip entry's CRC32, and a file
whose records hold no checksum (written before they were recorded) against all its zip CRC32s.
A mismatch names the file and the value: the checkpoint is damaged.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.integrity import DamagedZipEntryError, check_zip_entries, tensor_crc32
from lightning_pipe.checkpoint.metadata import (
    LIGHTNING_STATE_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    TensorEntry,
    part_file_name,
)

_SHOWN = 8
_EARLIER = "Use an earlier checkpoint."


class CheckpointDirectory:
    """A sharded checkpoint directory, opened for reading."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"The checkpoint {self.path} does not exist.")
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} is a file, not a sharded lightning_pipe checkpoint directory."
            )
        self.metadata = CheckpointMetadata.read(self.path)
        missing = sorted(f for f in self.metadata.files() if not (self.path / f).is_file())
        if missing:
            raise CheckpointError(
                f"The checkpoint {self.path} is incomplete: its metadata lists the shard files {missing}, "
                "which are not there. Copy the whole checkpoint directory, or use an earlier checkpoint."
            )
        self._files: dict[str, dict[str, Any]] = {}
        self._whole_files_checked: set[str] = set()

    def _check_zip(self, name: str, storages: bool) -> None:
        """``name``'s zip entries against their CRC32: the tensors' data too (``storages``), or not."""
        file = f"The {'shard ' if name != LIGHTNING_STATE_FILE else ''}file {self.path / name}"
        try:
            check_zip_entries(self.path / name, storages)
        except DamagedZipEntryError as err:
            raise CheckpointError(
                f"{file} is damaged: its entry {err.entry!r} does not match the "
                f"CRC32 recorded when it was written (torch.load does not check it). {_EARLIER}"
            ) from None
        except (OSError, zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(
                f"{file} cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged. {_EARLIER}"
            ) from err

    def _file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            # The pickle (non-tensor values, each tensor's layout) first: loading a damaged one
            # may give wrong values without an error.
            self._check_zip(name, storages=False)
            try:
                self._files[name] = torch.load(
                    self.path / name, map_location="cpu", weights_only=True, mmap=True
                )
            except Exception as err:
                raise CheckpointError(
                    f"The shard file {self.path / name} cannot be read ({type(err).__name__}: {err}); the "
                    f"checkpoint is damaged. {_EARLIER}"
                ) from err
        return self._files[name]

    def _check_bytes(self, record: TensorEntry, index: int, name: str, node: Any, what: str) -> None:
        """``node`` (the piece of a value read from the file ``name``) against its record's CRC32;
        a file of a checkpoint that recorded none is checked whole, once, against its zip's."""
        if record.crc32 is None:
            if record.shape is not None and name not in self._whole_files_checked:
                self._check_zip(name, storages=True)
                self._whole_files_checked.add(name)
            return
        if not isinstance(node, torch.Tensor):
            raise CheckpointError(
                f"The shard file {self.path / name} holds a {type(node).__name__} as {what}, where the "
                f"metadata records a tensor; the checkpoint is damaged. {_EARLIER}"
            )
        read, recorded = tensor_crc32(node), record.crc32[index]
        if read is not None and read != recorded:
            raise CheckpointError(
                f"The shard file {self.path / name} is damaged: the bytes of {what} in it do not match "
                f"the CRC32 recorded when it was saved (read {read:08x}, recorded {recorded:08x}), so "
                f"loading it would give other values than were saved. {_EARLIER}"
            )

    def _blocks(self, record: TensorEntry, what: str) -> list[tuple[int, int]]:
        """The expert blocks of a value split by experts, checked: one per file, in order, covering
        the experts of its shape without a gap or an overlap."""
        dim, blocks, shape = record.expert_dim, list(record.experts or ()), record.shape
        if shape is None or dim is None or not 0 <= dim < len(shape):
            raise CheckpointError(
                f"The metadata of {self.path} splits {what} by experts along dim {dim} of a value of "
                f"shape {shape}; the checkpoint is damaged. {_EARLIER}"
            )
        starts = [0] + [first + count for first, count in blocks[:-1]]
        if (
            len(blocks) != len(record.files)
            or [first for first, _ in blocks] != starts
            or sum(count for _, count in blocks) != shape[dim]
        ):
            raise CheckpointError(
                f"The metadata of {self.path} places the experts {blocks} of {what} in {len(record.files)} "
                f"files, which do not cover its {shape[dim]} experts once each; the checkpoint is damaged. "
                f"{_EARLIER}"
            )
        return blocks

    def _read(
        self, record: TensorEntry, where: tuple[str, ...], what: str, experts: range | None = None
    ) -> Any:
        if not record.files:
            raise CheckpointError(
                f"The metadata of {self.path} names no shard file for {what}; the checkpoint is damaged. "
                "Use an earlier checkpoint."
            )
        if record.crc32 is not None and len(record.crc32) != len(record.files):
            raise CheckpointError(
                f"The metadata of {self.path} records {len(record.crc32)} checksums for {what}, which it "
                f"places in {len(record.files)} files; the checkpoint is damaged. {_EARLIER}"
            )
        indices = range(len(record.files))
        blocks: list[tuple[int, int]] = []
        if record.expert_dim is not None:
            blocks = self._blocks(record, what)
            if experts is not None:  # the files holding the wanted experts only
                indices = range(0)
                wanted = [i for i, (f, n) in enumerate(blocks) if f < experts.stop and experts.start < f + n]
                if wanted:
                    indices = range(wanted[0], wanted[-1] + 1)
        parts = []
        for index in indices:
            name = record.files[index]
            node: Any = self._file(name)
            try:
                for step in where:
                    node = node[step]
            except (KeyError, IndexError, TypeError):
                raise CheckpointError(
                    f"The shard file {self.path / name} does not hold {what}, which the metadata places "
                    "there; the checkpoint is damaged. Use an earlier checkpoint."
                ) from None
            self._check_bytes(record, index, name, node, what)
            parts.append(node)
        if record.expert_dim is not None:
            return self._experts_of(record, parts, blocks, indices, experts, what)
        value = parts[0] if record.tp_dim is None else torch.cat(parts, dim=record.tp_dim)
        if record.shape is not None and (
            not isinstance(value, torch.Tensor) or tuple(value.shape) != record.shape
        ):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"{what} in {self.path} is {got}, but the metadata records {record.shape}; the "
                "checkpoint is damaged. Use an earlier checkpoint."
            )
        return value

    def _experts_of(
        self,
        record: TensorEntry,
        parts: list[Any],
        blocks: list[tuple[int, int]],
        indices: range,
        experts: range | None,
        what: str,
    ) -> torch.Tensor:
        """The experts ``experts`` (all: ``None``) of a value split by experts, from the ``parts``
        read from the files ``indices`` of its record, each checked against its block."""
        dim, shape = record.expert_dim, record.shape
        assert dim is not None and shape is not None  # checked by _blocks
        for index, part in zip(indices, parts, strict=True):
            expected = (*shape[:dim], blocks[index][1], *shape[dim + 1 :])
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != expected:
                got = tuple(part.shape) if isinstance(part, torch.Tensor) else type(part).__name__
                raise CheckpointError(
                    f"The experts {list(blocks[index])} of {what} in {self.path / record.files[index]} are "
                    f"{got}, but the metadata records {expected}; the checkpoint is damaged. {_EARLIER}"
                )
        if experts is None:
            return torch.cat(parts, dim=dim)
        if not parts or not (0 <= experts.start < experts.stop <= shape[dim]):
            raise CheckpointError(
                f"{what} in {self.path} holds {shape[dim]} experts; the experts [{experts.start}, "
                f"{experts.stop}) were asked for. Build the model it was saved from."
            )
        first = blocks[indices[0]][0]
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        return value.narrow(dim, experts.start - first, len(experts))

    def check_complete(self) -> None:
        """Raise unless the metadata and the shard files describe the same values, and every shard
        file the saving layout wrote is there.

        Each rank of the first replica wrote one file (``shard-pp{p}-tp{t}.pt``, and
        ``shard-pp{p}-tp{t}-ep{e}.pt`` under expert parallelism); every model and
        optimizer entry in a file must be recorded, with that file, in the metadata, and every
        file a record names must hold the entry. A metadata file that lost an entry would otherwise
        give a checkpoint without that tensor, or, when resuming, look like a checkpoint of another
        model ("keys do not match"), whose fix (loading fewer keys) would hide the damage. Reads
        the files' pickles only (memory-mapped), not their tensors.
        """
        layout = self.metadata.layout
        expected = [
            part_file_name(p, t, e)
            for p in range(layout["pipeline_parallel_size"])
            for t in range(layout["tensor_parallel_size"])
            for e in range(self.metadata.expert_parallel_size)
        ]
        absent = [f for f in expected if not (self.path / f).is_file()]
        if absent:
            raise CheckpointError(
                f"The checkpoint {self.path} is incomplete: the layout that saved it "
                f"(pp={layout['pipeline_parallel_size']} x tp={layout['tensor_parallel_size']}) writes "
                f"the shard files {expected}, and {absent} are not there. Copy the whole checkpoint "
                "directory, or use an earlier checkpoint."
            )
        held: set[tuple[str, ...]] = set()  # (file, "model", key) or (file, optimizer, param, key)
        for name in sorted(set(expected) | self.metadata.files()):
            payload = self._file(name)
            held.update((name, "model", key) for key in payload.get("model", {}))
            for index, entries in enumerate(payload.get("optimizers", [])):
                held.update((name, str(index), p, k) for p, state in entries.items() for k in state)
        recorded = {(f, "model", key) for key, r in self.metadata.model.items() for f in r.files} | {
            (f, str(index), p, k)
            for index, optimizer in enumerate(self.metadata.optimizers)
            for p, entries in optimizer.items()
            for k, r in entries.items()
            for f in r.files
        }
        unrecorded = [_describe(item) for item in sorted(held - recorded)]
        absent_values = [_describe(item) for item in sorted(recorded - held)]
        problems = []
        if unrecorded:
            problems.append(
                f"does not record {len(unrecorded)} value(s) its shard files hold: {_shown(unrecorded)}"
            )
        if absent_values:
            problems.append(
                f"places {len(absent_values)} value(s) in shard files that do not hold them: "
                f"{_shown(absent_values)}"
            )
        if problems:
            raise CheckpointError(
                f"The checkpoint {self.path} is damaged: its metadata ({METADATA_FILE}) "
                + "; it ".join(problems)
                + ". Reading it would silently leave values out or fail part-way; use an earlier "
                "checkpoint. (It is not a checkpoint of another model: do not load it with fewer "
                "keys.)"
            )

    def model_value(self, key: str, experts: range | None = None) -> Any:
        """The full saved value of the model's state-dict entry ``key``; of a value split by
        experts, only the global ``experts`` given (read from the files that hold them)."""
        return self._read(self.metadata.model[key], ("model", key), f"the model entry {key!r}", experts)

    def optimizer_value(
        self, index: int, param_name: str, state_key: str, experts: range | None = None
    ) -> Any:
        """The full saved ``state_key`` entry of optimizer ``index`` for parameter ``param_name``
        (only the global ``experts`` given, as :meth:`model_value`)."""
        record = self.metadata.optimizers[index][param_name][state_key]
        return self._read(
            record,
            ("optimizers", index, param_name, state_key),  # type: ignore[arg-type]
            f"optimizer {index}'s {state_key!r} for {param_name!r}",
            experts,
        )

    def lightning_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        """Everything Lightning saved besides the tensors: loops, callbacks, schedulers, hparams."""
        path = self.path / LIGHTNING_STATE_FILE
        if path.is_file():  # loops, schedulers' and optimizers' settings: small, checked whole
            self._check_zip(LIGHTNING_STATE_FILE, storages=True)
        try:
            state = torch.load(path, map_location="cpu", weights_only=weights_only is not False)
        except FileNotFoundError:
            raise CheckpointError(
                f"The checkpoint {self.path} has no {LIGHTNING_STATE_FILE}; it is damaged."
            ) from None
        except Exception as err:
            if weights_only is not False and "weights_only" in str(err):
                raise CheckpointError(
                    f"{path} holds objects that weights_only=True loading refuses ({err}). If you trust "
                    "this checkpoint, load it with weights_only=False: trainer.fit(..., "
                    "weights_only=False), or `python -m lightning_pipe.consolidate --trust-pickle`."
                ) from err
            raise CheckpointError(
                f"{path} cannot be read ({type(err).__name__}: {err}); it is damaged."
            ) from err
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dictionary.")
        return state


def _describe(item: tuple[str, ...]) -> str:
    if item[1] == "model":
        return f"model entry {item[2]!r} in {item[0]}"
    return f"optimizer {item[1]}'s {item[3]!r} for {item[2]!r} in {item[0]}"


def _shown(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{items[:_SHOWN]}{more}"
