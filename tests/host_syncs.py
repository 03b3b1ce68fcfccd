"""Count, on the CPU, the calls that would make the host wait for the device on CUDA.

On CUDA the host runs ahead of the device: kernels and collectives are queued and the Python code
goes on. Anything that reads a device tensor's value on the host (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ``int(t)``, ``t.__index__()``, ``.numpy()``, ``.cpu()``,
``torch.equal``, printing a tensor) or that makes an output whose shape depends on the values
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
an output size) stalls the host until the device has drained its queue. On the CPU nothing
really waits, so :class:`HostSyncCounter` records what *would* wait: every such call, with where
it was made (the first frame in ``lightning_pipe``, else in ``tests/``, else the innermost frame
outside torch).

Two torch modes see those calls: a ``TorchFunctionMode`` for the Python-level reads (the methods
above, and whether a tensor is known to live on the host), and a ``TorchDispatchMode`` for the
reads that happen inside C++ (``aten._local_scalar_dense`` under ``bool``, ``aten.equal``,
``aten.nonzero``, boolean ``aten.index``...). A read seen by both is counted once.

What is not counted, because it would not wait on CUDA either:

* a read of a tensor known to be on the host: made from Python data without a ``device=``
  (``torch.tensor([...])``, ``torch.zeros(3)``), the result of a ``.cpu()`` (itself counted once),
  or computed only from such tensors;
* ``tensor.to(device)``: on the CPU ``.to(self.device)`` cannot be told from a copy to the host, so
  only ``.to("cpu")`` written as the string ``"cpu"`` counts (as ``.cpu()`` does);
* ``host.copy_(device_tensor, non_blocking=True)``: queued, like a kernel (a blocking ``copy_``
  into a host tensor counts); whoever reads ``host`` later waits on CUDA for an event recorded
  right after the copy, i.e. for the work queued before it, not for the whole queue;
* collectives themselves (a gloo collective reads its CPU tensors, but on NCCL it is queued like a
  kernel); the reads *around* one count, e.g. the sizes ``broadcast_object_list`` reads.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class Sync:
    """One call that would make the host wait: what it was and where it was made."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
    torch.Tensor.__complex__: "complex",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "numpy",
    torch.Tensor.__repr__: "repr",
    torch.Tensor.__format__: "format",
    torch.Tensor.__contains__: "in",
    torch.Tensor.cpu: "cpu",
    torch.equal: "equal",
    torch.Tensor.equal: "equal",
    torch.allclose: "allclose",
    torch.Tensor.allclose: "allclose",
}
"""Python-level calls that read a tensor's value on the host (by the function torch hands the
mode), and their short names."""

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.from_numpy,
    torch.frombuffer,
}  # fmt: skip
"""Factories: without a ``device=`` their tensor is made on the host (``*_like`` follow their
input's placement instead, unless given a device)."""

_DATA_DEPENDENT = {
    "aten._local_scalar_dense": "item",
    "aten.is_nonzero": "bool",
    "aten.equal": "equal",
    "aten.nonzero": "nonzero",
    "aten.argwhere": "nonzero",
    "aten.masked_select": "masked_select",
    "aten._unique": "unique",
    "aten._unique2": "unique",
    "aten.unique_dim": "unique",
    "aten.unique_consecutive": "unique",
    "aten.unique_dim_consecutive": "unique",
    "aten.repeat_interleave": "repeat_interleave",
    "aten.bincount": "bincount",
    "aten.histc": "histc",
}
"""aten ops (by overload packet) that read values on the host or size their output by them."""

_BOOLEAN_INDEXING = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


def _where() -> str:
    """The first frame in lightning_pipe (else in tests/, else the innermost outside torch)."""
    frame = sys._getframe(2)
    ours = tests = outside = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/lightning_pipe/" in name and ours is None:
            ours = frame
            break
        mine = name.endswith("/tests/host_syncs.py")
        if "/tests/" in name and not mine and tests is None:
            tests = frame
        if outside is None and "/torch/" not in name and not mine:
            outside = frame
        frame = frame.f_back
    chosen = ours or tests or outside
    if chosen is None:
        return "?"
    name = chosen.f_code.co_filename
    for marker in ("/lightning_pipe/", "/tests/", "/site-packages/"):
        if marker in name:
            name = name[name.index(marker) + 1 :]
            break
    return f"{name}:{chosen.f_lineno} {chosen.f_code.co_name}"


class HostSyncCounter:
    """Records every would-be host synchronisation while :meth:`counting` is active.

    ``records``: one list of :class:`Sync` per counted scope (per training step, say), in order.
    """

    def __init__(self) -> None:
        self.records: list[list[Sync]] = []
        self._host = WeakIdKeyDictionary()
        """Tensors known to live on the host (see the module docstring)."""
        self._quiet = threading.local()
        counter = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                return counter._function(func, args, kwargs)

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                counter._dispatch(func, args, kwargs)
                return func(*args, **kwargs)

        self._modes = (_Functions, _Dispatch)

    # ------------------------------------------------------------------ what counts
    def _on_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(t in self._host for t in tensors)

    def _record(self, what: str) -> None:
        if self.records:
            self.records[-1].append(Sync(what, _where()))

    def _function(self, func: Any, args: Any, kwargs: Any) -> Any:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        read = _READS.get(func)
        if read is None and func is torch.Tensor.copy_ and len(args) > 1:
            # Into a host tensor from the device: a blocking copy waits; a non_blocking one is
            # queued (its reader waits, on CUDA, for an event recorded right after it: for the
            # work queued before the copy only).
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if args[0] in self._host and args[1] not in self._host and blocking:
                read = "copy to the host"
        if (
            read is None
            and func is torch.Tensor.to
            and (kwargs.get("device") == "cpu" or any(a == "cpu" for a in args[1:] if isinstance(a, str)))
        ):
            read = "to('cpu')"
        if read is not None:
            if not self._on_host(tensors):
                self._record(read)
            depth = getattr(self._quiet, "depth", 0)
            self._quiet.depth = depth + 1  # the aten reads under it are this one
            try:
                out = func(*args, **kwargs)
            finally:
                self._quiet.depth = depth
            if read in ("cpu", "to('cpu')") and isinstance(out, torch.Tensor):
                if tensors and out is tensors[0]:
                    # On the CPU a tensor's .cpu() is itself: the copy is a new view, so that the
                    # tensor itself stays on the "device".
                    out = out.view_as(out)
                self._host[out] = True
            return out
        out = func(*args, **kwargs)
        host = self._on_host(tensors) or (
            func in _FACTORIES and kwargs.get("device") is None and (not tensors or self._on_host(tensors))
        )
        if host and func is not torch.Tensor.to:  # .to(device) may move it to the device
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[t] = True
        return out

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> None:
        if getattr(self._quiet, "depth", 0):
            return
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        what = _DATA_DEPENDENT.get(name)
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is not None:
            what = None
        if what is None and name in _BOOLEAN_INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                what = "boolean indexing"
        if what is not None and not self._on_host(tensors):
            self._record(what)

    # ------------------------------------------------------------------ scopes
    @contextmanager
    def counting(self) -> Iterator[list[Sync]]:
        """Count inside the block (one new entry of :attr:`records`, which it yields)."""
        self.records.append([])
        functions, dispatch = self._modes
        with functions(), dispatch():
            yield self.records[-1]

    def wrap(self, obj: Any, name: str) -> None:
        """Count inside every call of ``obj.name`` (an instance attribute shadows the method)."""
        original = getattr(obj, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.counting():
                return original(*args, **kwargs)

        setattr(obj, name, counted)

    def per_step(self) -> list[dict[str, int]]:
        """Each scope's syncs, counted by ``"what at where"``."""
        return [dict(Counter(str(s) for s in step)) for step in self.records]
