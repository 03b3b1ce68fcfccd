"""Initial weights read from files, each rank reading only the tensors it materialises.

A model built on the meta device starts from pretrained weights when
:func:`~lightning_pipe.construction.materialize.materialize` is given a :class:`WeightFiles`: every
tensor the rank materialises is looked up by its state-dict key and read on its own, so a rank
reads its stage's tensors and no others (for a tensor-parallel slice, the full tensor is read
and cut, one tensor at a time; for a parameter holding a block of a mixture-of-experts layer's
stacked experts, marked with an :class:`~lightning_pipe.experts.shard.ExpertShard`, that block
only). This is weights only, not a resume: no optimizer or loop state.

Formats, told apart by what ``path`` is:

* a Hugging Face directory (``save_pretrained``): ``model.safetensors``, or the shards listed in
  ``model.safetensors.index.json``; each tensor read with ``safetensors.safe_open`` (memory-mapped);
* a single ``.safetensors`` file;
* a ``pipe_tp`` sharded checkpoint directory, whatever layout wrote it;
* a Lightning checkpoint file (``trainer.save_checkpoint`` with one file, a consolidated one) or a
  bare ``torch.save``-d state dict: opened with ``torch.load(mmap=True, weights_only=True)``, so
  only the pages of the tensors asked for are read.

``prefix`` maps the module's keys to the file's: a Hugging Face model kept as ``self.llama`` has
module keys ``llama.model.layers.0...`` and file keys ``model.layers.0...``, so ``prefix="llama."``.

A damaged file (truncated by a copy that stopped, an empty file, a corrupted header) is reported
with its own path and what to do, never as the reader library's bare error; keys the files hold
that the model does not use are listed by :meth:`WeightFiles.unused` (a misspelled or extra key
would otherwise pass unnoticed, as ``load_state_dict(strict=False)`` users know).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.metadata import CheckpointError, is_checkpoint_directory
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.experts.shard import ExpertShard

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_SHOWN = 8


def _damaged(path: Path, err: BaseException, kind: str) -> CheckpointError:
    """The error for a weights file that cannot be read: its path, that it is damaged, the fix."""
    size = path.stat().st_size if path.is_file() else None
    empty = " (it is empty)" if size == 0 else ""
    cause = str(err).splitlines()[0] if str(err) else type(err).__name__
    return CheckpointError(
        f"The pretrained weights file {path}{empty} cannot be read as {kind}: it is damaged or incomplete "
        f"(a download or copy that stopped part-way?). Copy or download it again. ({type(err).__name__}: "
        f"{cause})"
    )


class WeightFiles:
    """Tensors by state-dict key from weight files (see the module docstring for the formats)."""

    def __init__(self, path: str | Path, prefix: str = "") -> None:
        self.path, self.prefix = Path(path), prefix
        """What the user named: a directory or a file (messages name it)."""
        self.directory = self.path
        """Where the safetensors files named by the index (or the one file) are."""
        self._files: dict[str, Any] = {}  # safetensors file name -> open handle
        self._where: dict[str, str] = {}  # file key -> safetensors file name
        self._state: dict[str, Any] | None = None
        self._sharded: CheckpointDirectory | None = None
        if not self.path.exists():
            raise FileNotFoundError(f"The pretrained weights {self.path} do not exist.")
        if self.path.is_dir() and is_checkpoint_directory(self.path):
            self._sharded = CheckpointDirectory(self.path)
            self._sharded.check_complete()  # a damaged one is told so, not as keys it lacks
            self._keys = set(self._sharded.metadata.model)
        elif self.path.is_dir() and (self.path / _INDEX).is_file():
            self._read_index(self.path / _INDEX)
        elif self.path.is_dir() and (self.path / _SINGLE).is_file():
            self._index_file(_SINGLE)
        elif self.path.is_file() and self.path.suffix == ".safetensors":
            self.directory = self.path.parent
            self._index_file(self.path.name)
        elif self.path.is_file():
            try:
                loaded = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                if "weights_only" in str(err) or "Unsupported global" in str(err):
                    raise CheckpointError(
                        f"The pretrained weights file {self.path} holds objects that safe loading "
                        "(torch.load(weights_only=True)) refuses; save the state dict alone "
                        "(torch.save(model.state_dict(), path)) or consolidate the checkpoint with "
                        f"--weights-only. ({str(err).splitlines()[0]})"
                    ) from err
                raise _damaged(self.path, err, "a torch checkpoint (torch.load)") from err
            state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
            if not isinstance(state, dict):
                raise CheckpointError(f"{self.path} holds no state dict (got {type(loaded).__name__}).")
            self._state = state
            self._keys = {k for k, v in state.items() if isinstance(v, torch.Tensor)}
        else:
            raise CheckpointError(
                f"{self.path} is neither a weights file (.safetensors, .ckpt, .pt) nor a directory with "
                f"{_SINGLE}, {_INDEX} or a pipe_tp sharded checkpoint."
            )

    def _read_index(self, path: Path) -> None:
        try:
            index = json.loads(path.read_text())
            self._where = {str(k): str(v) for k, v in index["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _damaged(path, err, "a safetensors index (JSON with a 'weight_map')") from err
        missing = sorted({name for name in self._where.values() if not (self.directory / name).is_file()})
        if missing:
            raise CheckpointError(
                f"The pretrained weights index {path} lists the files {missing[:_SHOWN]}, which are not in "
                f"{self.directory}: the directory is incomplete. Copy or download the whole directory."
            )
        self._keys = set(self._where)

    def _index_file(self, name: str) -> None:
        handle = self._open(name)
        self._where = {key: name for key in handle.keys()}
        self._keys = set(self._where)

    def _open(self, name: str) -> Any:
        if name not in self._files:
            try:
                from safetensors import safe_open
            except ImportError as err:  # an optional dependency
                raise ImportError(
                    f"Reading {self.directory / name} needs the safetensors package: pip install safetensors"
                ) from err
            try:
                self._files[name] = safe_open(str(self.directory / name), framework="pt", device="cpu")
            except Exception as err:
                raise _damaged(self.directory / name, err, "safetensors") from err
        return self._files[name]

    def unused(self, module_keys: Iterable[str]) -> list[str]:
        """The files' keys that none of ``module_keys`` (the whole model's state-dict keys, every
        stage's) reads, sorted: an extra or misspelled key the model would silently ignore."""
        used = {found for key in module_keys if (found := self.file_key(key)) is not None}
        return sorted(self._keys - used)

    def file_key(self, key: str) -> str | None:
        """The file's key for the module's state-dict ``key``, or ``None`` if it has none."""
        if not key.startswith(self.prefix):
            return None
        key = key[len(self.prefix) :]
        return key if key in self._keys else None

    def get(self, key: str, experts: ExpertShard | None = None) -> torch.Tensor | None:
        """The full tensor for the module's state-dict ``key`` (``None`` when the files lack it);
        with ``experts``, only that block of experts along its dim, read alone where the format
        allows it (a safetensors slice, a sharded checkpoint's files holding those experts), so a
        rank reads ``1/E`` of a mixture-of-experts layer's stacked experts. A stored value whose
        expert dim is not ``experts.num_experts`` long is returned whole (the caller names the
        shape that does not fit)."""
        found = self.file_key(key)
        if found is None:
            return None
        if self._sharded is not None:
            record = self._sharded.metadata.model[found]
            fits = experts is not None and record.shape is not None and _fits(record.shape, experts)
            if fits and record.expert_dim == experts.dim:  # type: ignore[union-attr]
                return self._tensor(self._sharded.model_value(found, experts.experts), found)  # type: ignore[union-attr]
            value = self._sharded.model_value(found)
        elif self._state is not None:
            value = self._state[found]
        else:
            name = self._where[found]
            try:
                handle = self._open(name)
                if experts is not None and _fits(tuple(handle.get_slice(found).get_shape()), experts):
                    block = slice(experts.first_expert, experts.first_expert + experts.local_experts)
                    return self._tensor(
                        handle.get_slice(found)[(slice(None),) * experts.dim + (block,)], found
                    )
                value = handle.get_tensor(found)
            except CheckpointError:
                raise
            except Exception as err:
                raise _damaged(self.directory / name, err, f"safetensors (reading {found!r})") from err
        value = self._tensor(value, found)
        if experts is not None and _fits(tuple(value.shape), experts):
            return value.narrow(experts.dim, experts.first_expert, experts.local_experts)
        return value

    def _tensor(self, value: Any, found: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"The entry {found!r} of {self.path} is not a tensor.")
        return value

    def __repr__(self) -> str:
        return f"WeightFiles({str(self.path)!r}, prefix={self.prefix!r})"


def _fits(shape: tuple[int, ...], experts: ExpertShard) -> bool:
    """Whether a stored value of ``shape`` holds every expert along ``experts.dim``."""
    return len(shape) > experts.dim and shape[experts.dim] == experts.num_experts
