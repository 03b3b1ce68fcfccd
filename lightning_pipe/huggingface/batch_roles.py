"""Which of a batch's tensors the step gives the Hugging Face model, learned from the step itself.

A step may unpack its batch any way: ``self.model(**batch)`` on a collator's dict, ``ids, mask,
labels = batch`` on a ``TensorDataset``'s tuple, ``batch.tokens`` on a dataclass, a dict with its
own key names. The pipeline's first stage needs the input ids, the attention mask and the position
ids before the step runs (on the last stage), and the runtime needs the labels to weigh the
micro-batches by their tokens. So on the first batch of each step kind (and batch structure) the
strategy runs the step once with the model's ``forward`` replaced by a recorder that stops the step
at its model call (no layer computes, no rank needs other stages' weights), and the tensors given
to the call are matched *by identity* to the batch's leaves (:func:`learn_roles`): the result,
:class:`BatchRoles`, is where in the batch each role sits (``batch[1]``, ``batch['mask']``,
``batch.mask``), the same for every micro-batch, which is cut from the batch along dim 0 with its
structure kept. Every rank learns it on its own batch and the ranks must agree.

A tensor the step builds itself (``mask = ids != pad``, a slice ``ids[:, :-1]``) is not a leaf of
the batch; the first stage cannot rebuild it, so it is refused, naming the batch as it is and
``pipeline_input`` (the module's own hook that returns a collator's dict from any batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.huggingface.outputs import ModelCallError

ROLES = ("input_ids", "attention_mask", "position_ids", "labels", "shift_labels")
"""The model call's arguments the pipeline and the token weighting read from the batch."""

Step = tuple[str, Any]
"""One step into a batch: ``("item", key_or_index)`` (a dict, tuple or list) or ``("attr", name)``
(a dataclass field)."""
Path = tuple[Step, ...]


class BatchRolesError(ModelCallError):
    """The step gives the model a tensor that is not one of the batch's (it builds it itself)."""


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def split_fields(obj: Any) -> list[str]:
    """A dataclass batch's fields that micro-batching cuts (those ``__init__`` takes; see
    :mod:`lightning_pipe.batches.microbatch`)."""
    return [f.name for f in dataclasses.fields(obj) if f.init]


def leaves(batch: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """The batch's tensors with their paths, in order (dicts, tuples, lists, dataclasses)."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from leaves(value, (*path, ("item", key)))
    elif isinstance(batch, tuple | list):
        for index, value in enumerate(batch):
            yield from leaves(value, (*path, ("item", index)))
    elif is_dataclass_instance(batch):
        for name in split_fields(batch):
            yield from leaves(getattr(batch, name), (*path, ("attr", name)))


def describe(path: Path) -> str:
    """How the step writes the path: ``batch[0]``, ``batch['mask']``, ``batch.mask``."""
    return "batch" + "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in path)


def fetch(batch: Any, path: Path) -> Any:
    value = batch
    for kind, key in path:
        value = getattr(value, key) if kind == "attr" else value[key]
    return value


def structure(batch: Any) -> tuple[Any, ...]:
    """The batch's structure without its sizes: the roles learned on one batch hold for another
    batch of the same structure."""
    return (type(batch).__name__, *(path for path, _ in leaves(batch)))


def kind_of(batch: Any) -> str:
    """The batch's type as a message names it."""
    if is_dataclass_instance(batch):
        return f"{type(batch).__name__} dataclass"
    if isinstance(batch, torch.Tensor):
        return "tensor"
    return type(batch).__name__


@dataclass(frozen=True)
class BatchRoles:
    """Where in a batch each role of the model call sits (see the module docstring)."""

    paths: tuple[tuple[str, Path], ...]
    """``(role, path)`` for each role the step's call gives (``input_ids`` always)."""

    def select(self, batch: Any) -> dict[str, torch.Tensor]:
        """The batch's tensors by role: a dict as Hugging Face's collators give."""
        out: dict[str, torch.Tensor] = {}
        for role, path in self.paths:
            try:
                out[role] = fetch(batch, path)
            except (KeyError, IndexError, AttributeError, TypeError) as err:
                raise BatchRolesError(
                    f"A batch ({kind_of(batch)}) has no {describe(path)}, where the step found its {role} on "
                    f"the first batch of this structure ({self}); batches of one structure must keep their "
                    "tensors in the same places."
                ) from err
        return out

    def sources(self) -> dict[str, str]:
        """Role -> where the step takes it (for messages)."""
        return {role: describe(path) for role, path in self.paths}

    def __str__(self) -> str:
        return ", ".join(f"{role}={describe(path)}" for role, path in self.paths)


def learn_roles(batch: Any, given: Mapping[str, Any], call: str) -> BatchRoles | None:
    """The roles of the tensors ``given`` to the model call (its bound arguments) in ``batch``;
    ``None`` when the call gives no ``input_ids`` tensor (the model call refuses it itself).

    Without labels in the call, a dict batch's ``'labels'`` still counts the tokens (a step that
    takes its own cross-entropy over them). ``call``: how messages name the call
    (``"training_step calls LlamaForCausalLM"``)."""
    if not isinstance(given.get("input_ids"), torch.Tensor):
        return None
    found = list(leaves(batch))
    paths: dict[str, Path] = {}
    for role in ROLES:
        value = given.get(role)
        if not isinstance(value, torch.Tensor):
            continue
        path = next((p for p, leaf in found if leaf is value), None)
        if path is None:
            raise BatchRolesError(built_in_step(batch, found, role, call))
        paths[role] = path
    if "labels" not in paths and "shift_labels" not in paths and isinstance(batch, Mapping):
        if isinstance(batch.get("labels"), torch.Tensor):
            paths["labels"] = (("item", "labels"),)
    return BatchRoles(tuple(paths.items()))


def built_in_step(batch: Any, found: list[tuple[Path, torch.Tensor]], role: str, call: str) -> str:
    """The refusal of a ``role`` tensor that is not one of the batch's, written for its type."""
    kind = kind_of(batch)
    held = ", ".join(f"{describe(p)} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for p, t in found)
    if is_dataclass_instance(batch):
        put = f"add a field for it to {type(batch).__name__}"
    elif isinstance(batch, Mapping):
        put = f"add a key {role!r} to the dict (in the collate_fn)"
    elif isinstance(batch, tuple | list):
        put = f"add it to the {kind} (a tensor of the TensorDataset, or from the collate_fn)"
    else:
        put = "make the batch a tuple or dict that holds it"
    return (
        f"{call} with {role}= a tensor that is not one of the batch's: the batch is a {kind} holding "
        f"{held or 'no tensor'}, so the step builds the {role} itself (e.g. a mask from the ids, "
        "`ids != pad_id`, or a slice of a batch tensor). Under pipe_tp the pipeline's first stage needs the "
        f"model's inputs before the step runs, so they must be the batch's own tensors: {put}, or define "
        "pipeline_input(self, batch) on the LightningModule returning a dict {'input_ids': ..., "
        f"{role!r}: ..., ...}} computed from this {kind} the same way (the step's call must give the same "
        "values)."
    )


class StepInputs:
    """The roles learned for each step kind and batch structure, and those of the step running
    (which the pipeline's input, its token counts and the model call read)."""

    def __init__(self) -> None:
        self.learned: dict[tuple[str, tuple[Any, ...]], BatchRoles | None] = {}
        self.active: BatchRoles | None = None
        """``None``: the batch as it is (a collator's dict, or ids first)."""

    @staticmethod
    def key(step_name: str, batch: Any) -> tuple[str, tuple[Any, ...]]:
        return step_name, structure(batch)

    def select(self, batch: Any) -> Any:
        """The batch's tensors by role (a dict), or the batch itself when nothing was learned."""
        return batch if self.active is None else self.active.select(batch)

    def sources(self) -> dict[str, str] | None:
        return None if self.active is None else self.active.sources()
