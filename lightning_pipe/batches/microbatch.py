"""Split a batch into micro-batches along dim 0, and describe micro-batches by their shapes.

Supported batches are tensors and (nested) tuples, lists, dicts and dataclass instances of them
(a dataclass's fields that ``__init__`` takes are split, the micro-batch made with
``dataclasses.replace``); any other leaf (a string, a number, ``None``) is copied unchanged into
every micro-batch. A batch whose size does not
divide by ``num_microbatches`` is split unevenly, like :func:`torch.tensor_split`: the first
``size % num_microbatches`` micro-batches get one extra sample. Losses are then weighted by each
micro-batch's share of the samples, so the gradient is still that of the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def split_fields(obj: Any) -> list[str]:
    """The fields of a dataclass instance that micro-batching splits (those ``__init__`` takes)."""
    return [f.name for f in dataclasses.fields(obj) if f.init]


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple, list, dict or dataclass, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, tuple | list):
        return [t for v in obj for t in tensors_of(v)]
    if is_dataclass_instance(obj):
        return [t for name in split_fields(obj) for t in tensors_of(getattr(obj, name))]
    return []


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, over the structures a batch may have
    (the ones :func:`tensors_of` reads); other leaves kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if is_dataclass_instance(obj):
        return dataclasses.replace(obj, **{k: map_tensors(getattr(obj, k), fn) for k in split_fields(obj)})
    return obj


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the first tensor in ``batch``."""
    tensors = tensors_of(batch)
    if not tensors:
        raise TypeError(
            f"Cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no "
            "tensor. Supported batches are tensors and tuples, lists, dicts or dataclasses of tensors (other "
            "leaves are copied to every micro-batch)."
        )
    first = tensors[0]
    if first.dim() == 0:
        raise TypeError("Cannot split a batch whose first tensor is a scalar (0-dim) into micro-batches.")
    return int(first.shape[0])


def _split(obj: Any, sizes: list[int], size: int) -> list[Any]:
    m = len(sizes)
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != size:
            shape = tuple(obj.shape)
            raise ValueError(
                f"All tensors of a batch must share dim 0 to be split into micro-batches: the first "
                f"tensor has {size} rows but another has shape {shape}. Move per-batch constants out "
                "of the batch or give them the batch dimension."
            )
        return list(torch.split(obj, sizes))
    if isinstance(obj, Mapping):
        parts = {k: _split(v, sizes, size) for k, v in obj.items()}
        return [type(obj)({k: parts[k][i] for k in obj}) for i in range(m)]  # type: ignore[call-arg]
    if isinstance(obj, tuple | list):
        columns = [_split(v, sizes, size) for v in obj]
        rows = [[c[i] for c in columns] for i in range(m)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return [type(obj)(*row) for row in rows]
        return [type(obj)(row) for row in rows]
    if is_dataclass_instance(obj):
        fields = {name: _split(getattr(obj, name), sizes, size) for name in split_fields(obj)}
        return [dataclasses.replace(obj, **{k: v[i] for k, v in fields.items()}) for i in range(m)]
    return [obj] * m


def microbatch_sizes(size: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batches of a batch of ``size`` samples (uneven like ``tensor_split``)."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
    if size < num_microbatches:
        raise ValueError(
            f"A batch of {size} samples cannot be split into {num_microbatches} micro-batches: "
            f"use a batch size of at least {num_microbatches} or lower num_microbatches."
        )
    base, extra = divmod(size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split ``batch`` into ``num_microbatches`` pieces along dim 0 (see the module docstring)."""
    size = batch_size(batch)
    return _split(batch, microbatch_sizes(size, num_microbatches), size)


def signature(obj: Any) -> Hashable:
    """A hashable description of the tensors' shapes and dtypes in ``obj`` (its structure too).

    Two micro-batches with equal signatures produce activations of equal shapes in any model whose
    shapes depend only on its input's shapes, which lets the executor skip shape messages.
    """
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype)
    if isinstance(obj, Mapping):
        return ("D", tuple((k, signature(v)) for k, v in obj.items()))
    if isinstance(obj, tuple | list):
        return ("L", tuple(signature(v) for v in obj))
    if is_dataclass_instance(obj):
        return ("C", type(obj).__name__, tuple((k, signature(getattr(obj, k))) for k in split_fields(obj)))
    return ("O", type(obj).__name__)


def as_layer_arguments(value: Any) -> Any:
    """What ``pipeline_input`` returned, as the first layer is called with it: a tuple, or a list,
    becomes its positional arguments (``layer(*value)``), as a layer's tuple output does for the
    next layer; anything else is its one argument."""
    return tuple(value) if isinstance(value, list) else value
