"""Which of a batch's tensors the step gives the Hugging Face model, learned from the step itself.

A step may unpack its batch any way: ``self.model(**batch)`` on a collator's dict, ``ids, mask,
labels = batch`` on a ``TensorDataset``'s tuple, ``batch.tokens`` on a dataclass, a dict with its
own key names. The pipeline's first stage needs the input ids, the attention mask and the position
ids before the step runs (on the last stage), and the runtime needs the labels to weigh the
micro-batches by their tokens. So on the first batch of each step kind (and batch structure) the
strategy runs the step once with the model's ``forward`` replaced by a recorder that stops the step
at its model call (no layer computes, no rank needs other stages' weights), and the tensors given
to the call are matched to the batch's leaves (:func:`learn_roles`; by identity, else by equal
values, as a step's ``ids.clone()`` or ``.long()`` gives): the result,
:class:`BatchRoles`, is where in the batch each role sits (``batch[1]``, ``batch['mask']``,
``batch.mask``), the same for every micro-batch, which is cut from the batch along dim 0 with its
structure kept. Every rank of a model replica learns it on its own batch and they must agree.

An input the step builds itself (``mask = ids != pad``, a slice ``ids[:, :-1]``) is no leaf of the
batch; the first stage cannot rebuild it, so it is refused, naming the batch as it is and
``pipeline_input`` (the module's own hook that returns a collator's dict from any batch). Labels
(and default positions) the step builds are left to the model call's own checks: the pipeline
does not need them, they only choose how the micro-batches are weighted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.huggingface.context import default_positions
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

    A given tensor is the batch leaf that *is* it, else one with equal values (a step's
    ``ids.clone()``, or ``.long()`` of an int32 batch tensor: same shape and values, any dtype).
    Labels, shift_labels, and position_ids equal to the default positions, that no leaf holds are
    left out (the pipeline does not need them: the model call then checks them as it checks any
    step's, on every micro-batch); input_ids, attention_mask or other positions that no leaf holds
    are refused, since the first stage needs them before the step runs.

    Without labels in the call, a dict batch's ``'labels'`` still counts the tokens (a step that
    takes its own cross-entropy over them). ``call``: how messages name the call
    (``"training_step calls LlamaForCausalLM"``)."""
    ids = given.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return None
    found = list(leaves(batch))
    paths: dict[str, Path] = {}
    for role in ROLES:
        value = given.get(role)
        if not isinstance(value, torch.Tensor):
            continue
        path = next((p for p, leaf in found if leaf is value), None)
        if path is None:
            path = next((p for p, leaf in found if same_values(leaf, value)), None)
        if path is not None:
            paths[role] = path
        elif role in ("labels", "shift_labels") or (role == "position_ids" and is_default(value, ids)):
            continue
        else:
            raise BatchRolesError(built_in_step(batch, found, role, call))
    if "labels" not in paths and "shift_labels" not in paths and isinstance(batch, Mapping):
        if isinstance(batch.get("labels"), torch.Tensor):
            paths["labels"] = (("item", "labels"),)
    return BatchRoles(tuple(paths.items()))


def same_values(leaf: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` holds ``leaf``'s values (what a step's ``.clone()``, ``.long()`` or
    ``.to(device)`` of a batch tensor gives): same shape, equal in either's dtype."""
    if leaf.shape != value.shape:
        return False
    value = value.to(leaf.device)
    return torch.equal(leaf, value.to(leaf.dtype)) and torch.equal(leaf.to(value.dtype), value)


def is_default(positions: torch.Tensor, input_ids: torch.Tensor) -> bool:
    """Whether ``positions`` are the model's own (``arange`` of the sequence, for every sample)."""
    try:
        positions = positions.expand_as(input_ids)
    except RuntimeError:
        return False
    return same_values(default_positions(input_ids), positions)


def structural_copy(batch: Any) -> Any:
    """``batch`` with new containers (dicts, lists, tuples, namedtuples, dataclasses) holding the
    same tensor objects: a step may change the copy's containers (``batch.pop('labels')``) without
    changing the batch, and its tensors are still found by identity."""
    if isinstance(batch, Mapping):
        items = {key: structural_copy(value) for key, value in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that its items cannot build
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(structural_copy(value) for value in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(structural_copy(value) for value in batch)
    if is_dataclass_instance(batch):
        fields = {name: structural_copy(getattr(batch, name)) for name in split_fields(batch)}
        return dataclasses.replace(batch, **fields)
    return batch


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
