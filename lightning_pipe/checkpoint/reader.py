"""Read values out of a sharded checkpoint, whole, whatever layout wrote it.

:class:`CheckpointDirectory` returns each value as the full (unsharded) tensor: the shards listed by
its record, concatenated along the saved ``tp_dim``. Callers then cut the slice their own layout
needs. Shard files are opened once each with ``mmap=True``, so a rank that needs a few of a file's
tensors reads those pages, not the file, and always with ``weights_only=True``: a shard file holds
nothing but tensors, strings and numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.metadata import (
    LIGHTNING_STATE_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    TensorEntry,
    part_file_name,
)

_SHOWN = 8


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

    def _file(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            try:
                self._files[name] = torch.load(
                    self.path / name, map_location="cpu", weights_only=True, mmap=True
                )
            except Exception as err:
                raise CheckpointError(
                    f"The shard file {self.path / name} cannot be read ({type(err).__name__}: {err}); the "
                    "checkpoint is damaged. Use an earlier checkpoint."
                ) from err
        return self._files[name]

    def _read(self, record: TensorEntry, where: tuple[str, ...], what: str) -> Any:
        if not record.files:
            raise CheckpointError(
                f"The metadata of {self.path} names no shard file for {what}; the checkpoint is damaged. "
                "Use an earlier checkpoint."
            )
        parts = []
        for name in record.files:
            node: Any = self._file(name)
            try:
                for step in where:
                    node = node[step]
            except (KeyError, IndexError, TypeError):
                raise CheckpointError(
                    f"The shard file {self.path / name} has no {what}, which the metadata places there; "
                    "the checkpoint is damaged. Use an earlier checkpoint."
                ) from None
            parts.append(node)
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

    def check_complete(self) -> None:
        """Raise unless the metadata describes every value the shard files hold, and every shard
        file the saving layout wrote is there.

        Resuming checks the keys against the model; an offline reader (consolidation) has no model,
        so it checks against the files themselves: each rank of the first replica wrote one file
        (``shard-pp{p}-tp{t}.pt``), and every model entry and optimizer entry in a file must be
        recorded, with that file, in the metadata. A metadata file that lost an entry would
        otherwise give a checkpoint without that tensor.
        """
        layout = self.metadata.layout
        expected = [
            part_file_name(p, t)
            for p in range(layout["pipeline_parallel_size"])
            for t in range(layout["tensor_parallel_size"])
        ]
        absent = [f for f in expected if not (self.path / f).is_file()]
        if absent:
            raise CheckpointError(
                f"The checkpoint {self.path} is incomplete: the layout that saved it "
                f"(pp={layout['pipeline_parallel_size']} x tp={layout['tensor_parallel_size']}) writes "
                f"the shard files {expected}, and {absent} are not there. Copy the whole checkpoint "
                "directory, or use an earlier checkpoint."
            )
        unrecorded: list[str] = []
        for name in expected:
            payload = self._file(name)
            for key in payload.get("model", {}):
                record = self.metadata.model.get(key)
                if record is None or name not in record.files:
                    unrecorded.append(f"model entry {key!r} in {name}")
            for index, entries in enumerate(payload.get("optimizers", [])):
                records = self.metadata.optimizers[index] if index < len(self.metadata.optimizers) else {}
                for param, state in entries.items():
                    for key in state:
                        record = records.get(param, {}).get(key)
                        if record is None or name not in record.files:
                            unrecorded.append(f"optimizer {index}'s {key!r} for {param!r} in {name}")
        if unrecorded:
            more = f" and {len(unrecorded) - _SHOWN} more" if len(unrecorded) > _SHOWN else ""
            raise CheckpointError(
                f"The checkpoint {self.path} is damaged: its metadata ({METADATA_FILE}) does not "
                f"record {len(unrecorded)} value(s) its shard files hold: {unrecorded[:_SHOWN]}{more}. "
                "Reading it would silently leave them out; use an earlier checkpoint."
            )

    def model_value(self, key: str) -> Any:
        """The full saved value of the model's state-dict entry ``key``."""
        return self._read(self.metadata.model[key], ("model", key), f"the model entry {key!r}")

    def optimizer_value(self, index: int, param_name: str, state_key: str) -> Any:
        """The full saved ``state_key`` entry of optimizer ``index`` for parameter ``param_name``."""
        record = self.metadata.optimizers[index][param_name][state_key]
        return self._read(
            record,
            ("optimizers", index, param_name, state_key),  # type: ignore[arg-type]
            f"optimizer {index}'s {state_key!r} for {param_name!r}",
        )

    def lightning_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        """Everything Lightning saved besides the tensors: loops, callbacks, schedulers, hparams."""
        path = self.path / LIGHTNING_STATE_FILE
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
