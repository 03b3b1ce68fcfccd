"""The on-disk layout of a sharded checkpoint, described by one JSON metadata file.

A sharded checkpoint is a directory (named like a file, ``epoch=3-step=120.ckpt``, so that
``ModelCheckpoint`` keeps, ranks and deletes it as it would a file)::

    epoch=3-step=120.ckpt/
        pipe_tp_metadata.json     layout, and where every tensor of every shard lives
        HOW_TO_LOAD.txt           for a person: how to resume, load or consolidate it
        lightning_state.pt        everything else Lightning saves (loops, callbacks, schedulers...)
        shard-pp0-tp0.pt          stage 0's tensors as tensor rank 0 holds them
        shard-pp0-tp1.pt          ...

Each ``shard-*.pt`` is written by one rank of the first data-parallel replica and holds the model
and optimizer tensors of its pipeline stage, its own slice of each tensor-parallel parameter and (on
tensor rank 0 only) the replicated ones. Under expert parallelism the other ranks of the first
expert group write one more file each, ``shard-pp{p}-tp{t}-ep{e}.pt``, with their experts (the
parameters marked with an :class:`~lightning_pipe.experts.shard.ExpertShard`) and those experts'
optimizer state: a record of an expert value lists each block's file and global expert range, so the
value is whole by global expert index and any expert-parallel size cuts its own block. Tensors are
keyed by the names of the *unsharded* LightningModule: state-dict keys for the model, parameter
names for the optimizer. Each :class:`TensorEntry` says which files hold a value and along which dim
to concatenate them, so a reader needs no knowledge of the layout that wrote it: that is what lets a
checkpoint move between layouts and be consolidated offline.

The metadata file is written last, so a directory without it is an incomplete save, never mistaken
for a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_pipe.checkpoint.durable import write_text_durably

FORMAT = "lightning_pipe.sharded_checkpoint"
VERSION = 1
"""Written for a checkpoint without expert blocks: what lightning_pipe wrote before it knew of
experts, so that its earlier releases still read it."""
EXPERT_VERSION = 2
"""Written for a checkpoint with values split by experts (records with ``expert_dim``): a release
that reads only version 1 refuses it, instead of reading one block as the whole value."""
READABLE_VERSIONS = (VERSION, EXPERT_VERSION)
METADATA_FILE = "pipe_tp_metadata.json"
LIGHTNING_STATE_FILE = "lightning_state.pt"
HOW_TO_LOAD_FILE = "HOW_TO_LOAD.txt"
"""Written into every sharded checkpoint: what to do with it."""
HOW_TO_LOAD = """\
This directory is one lightning_pipe (pipe_tp) sharded checkpoint. Ways to use it:

* Resume or continue training, at any pipe_tp layout:
      trainer.fit(model, ckpt_path="<this directory>")   # Trainer(strategy="pipe_tp", ...)
* Load it into a plain module (inference, strategy="auto"), in one process:
      import lightning_pipe
      model = lightning_pipe.load_from_checkpoint(MyModel, "<this directory>")
  (MyModel.load_from_checkpoint reads files only: it fails here with IsADirectoryError.)
* Turn it into one ordinary Lightning checkpoint file:
      python -m lightning_pipe.consolidate "<this directory>" model.ckpt [--weights-only]
* Of a Hugging Face model: into a directory AutoModelForCausalLM.from_pretrained reads:
      python -m lightning_pipe.consolidate "<this directory>" OUT_DIR --to-huggingface
* Without Lightning (lightning_pipe.runtime.ParallelRuntime), at any layout:
      extra = runtime.load_checkpoint("<this directory>", [optimizer])
"""
LAYOUT_KEYS = ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size")
EXPERT_LAYOUT_KEY = "expert_parallel_size"
"""In the layout of a version-2 checkpoint only (absent: 1)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved, read or loaded into this model, and why."""


def part_file_name(pp_rank: int, tp_rank: int, ep_rank: int = 0) -> str:
    """The file a writing rank saves: its pipeline and tensor rank's, and, for the other ranks of
    the first expert group (``ep_rank > 0``), its expert block's."""
    experts = f"-ep{ep_rank}" if ep_rank else ""
    return f"shard-pp{pp_rank}-tp{tp_rank}{experts}.pt"


@dataclass(frozen=True)
class TensorEntry:
    """Where one saved value lives.

    ``files`` lists the shard files holding it: one file for a replicated value, one per tensor
    rank (in tensor-rank order) for a value split along ``tp_dim``. ``shape`` is the full
    (unsharded) shape and ``dtype`` the dtype name; both are ``None`` for a non-tensor value such
    as an optimizer's integer step count.

    ``crc32`` holds, per file of ``files``, the CRC32 of the bytes of the value's piece in that file
    (:func:`~lightning_pipe.checkpoint.integrity.tensor_crc32`), checked on every read; ``None``
    for a non-tensor value and in checkpoints written before lightning_pipe recorded them (those
    load as before, their files checked against the zip entries' own CRC32 instead). Two records
    that differ only in it are equal: it describes the bytes, not where the value lives.

    ``expert_dim``: for a value split by experts (a mixture-of-experts layer's stacked experts under
    expert parallelism), the dim its blocks are stacked along; ``experts`` then holds, per file,
    the block's ``(first expert, count)`` in global expert indices, and ``shape`` the whole value
    (every expert). A value is split along ``tp_dim`` or ``expert_dim``, never both.
    """

    files: tuple[str, ...]
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    tp_dim: int | None = None
    crc32: tuple[int, ...] | None = field(default=None, compare=False)
    expert_dim: int | None = None
    experts: tuple[tuple[int, int], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "files": list(self.files),
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
            "tp_dim": self.tp_dim,
        }
        if self.crc32 is not None:  # absent, not null: readers of version 1 ignore the key
            out["crc32"] = list(self.crc32)
        if self.expert_dim is not None:  # only in version 2 (see EXPERT_VERSION)
            out["expert_dim"] = self.expert_dim
            out["experts"] = [list(block) for block in self.experts or ()]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorEntry:
        shape, crc32, experts = data.get("shape"), data.get("crc32"), data.get("experts")
        return cls(
            files=tuple(data["files"]),
            shape=None if shape is None else tuple(shape),
            dtype=data.get("dtype"),
            tp_dim=data.get("tp_dim"),
            crc32=None if crc32 is None else tuple(int(c) for c in crc32),
            expert_dim=data.get("expert_dim"),
            experts=None if experts is None else tuple((int(f), int(n)) for f, n in experts),
        )


OptimizerEntries = dict[str, dict[str, TensorEntry]]
"""Parameter name -> optimizer state key (``exp_avg``, ``momentum_buffer``, ``step``...) -> record."""


@dataclass
class CheckpointMetadata:
    """Contents of ``pipe_tp_metadata.json``."""

    layout: dict[str, int]
    """``data_parallel_size``, ``pipeline_parallel_size``, ``tensor_parallel_size`` of the saver
    (and ``expert_parallel_size`` when it was over 1)."""
    layer_names: list[str]
    balance: list[int]
    model: dict[str, TensorEntry] = field(default_factory=dict)
    """State-dict key -> record, in the module's state-dict order."""
    optimizers: list[OptimizerEntries] = field(default_factory=list)

    @property
    def expert_parallel_size(self) -> int:
        return self.layout.get(EXPERT_LAYOUT_KEY, 1)

    @property
    def version(self) -> int:
        """The format version this checkpoint needs: 2 with expert blocks, 1 (readable by every
        release) otherwise."""
        records = [
            *self.model.values(),
            *(r for opt in self.optimizers for e in opt.values() for r in e.values()),
        ]
        split = self.expert_parallel_size > 1 or any(r.expert_dim is not None for r in records)
        return EXPERT_VERSION if split else VERSION

    def to_json(self) -> dict[str, Any]:
        layout = {k: v for k, v in self.layout.items() if k != EXPERT_LAYOUT_KEY or v > 1}
        return {
            "format": FORMAT,
            "version": self.version,
            "layout": layout,
            "layer_names": self.layer_names,
            "balance": self.balance,
            "lightning_state": LIGHTNING_STATE_FILE,
            "model": {key: record.to_json() for key, record in self.model.items()},
            "optimizers": [
                {name: {k: r.to_json() for k, r in entries.items()} for name, entries in optimizer.items()}
                for optimizer in self.optimizers
            ],
        }

    @classmethod
    def from_json(cls, data: Any, where: Path) -> CheckpointMetadata:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(
                f"{where} is not a lightning_pipe checkpoint metadata file (format {found!r})."
            )
        if data.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where} has checkpoint format version {data.get('version')!r}; this lightning_pipe "
                f"reads version {VERSION} or {EXPERT_VERSION}. Load it with the lightning_pipe release that "
                "wrote it and consolidate it (python -m lightning_pipe.consolidate) into a single-file "
                "checkpoint."
            )
        try:
            layout = {k: int(v) for k, v in data["layout"].items()}
            if set(layout) - {EXPERT_LAYOUT_KEY} != set(LAYOUT_KEYS) or min(layout.values()) < 1:
                raise ValueError(
                    f"layout {layout}, expected positive sizes for {list(LAYOUT_KEYS)} (and, optionally, "
                    f"{EXPERT_LAYOUT_KEY!r})"
                )
            return cls(
                layout=layout,
                layer_names=list(data["layer_names"]),
                balance=[int(b) for b in data["balance"]],
                model={key: TensorEntry.from_json(r) for key, r in data["model"].items()},
                optimizers=[
                    {
                        name: {k: TensorEntry.from_json(r) for k, r in entries.items()}
                        for name, entries in opt.items()
                    }
                    for opt in data["optimizers"]
                ],
            )
        except KeyError as err:
            raise CheckpointError(
                f"{where} is damaged: it has no {err.args[0]!r} entry. Use an earlier checkpoint."
            ) from err
        except (AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where} is damaged: {type(err).__name__}: {err}") from err

    def files(self) -> set[str]:
        """Every shard file the metadata refers to."""
        records = [
            *self.model.values(),
            *(r for opt in self.optimizers for e in opt.values() for r in e.values()),
        ]
        return {f for record in records for f in record.files}

    def write(self, directory: Path) -> None:
        write_text_durably(directory / METADATA_FILE, json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, directory: Path) -> CheckpointMetadata:
        path = directory / METADATA_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory} is a directory without {METADATA_FILE}, so it is not a complete lightning_pipe "
                "checkpoint (the metadata is written last: a save that stopped part-way leaves none). "
                "Pass a checkpoint directory that ModelCheckpoint or trainer.save_checkpoint completed."
            ) from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path} is damaged (not valid JSON: {err}).") from err
        return cls.from_json(data, path)


def is_checkpoint_directory(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a sharded checkpoint's metadata file."""
    return (Path(path) / METADATA_FILE).is_file()
