"""A step's results, from one rank to its peers, without the host waiting for its device.

After a batch the last stage's results (the loss, the logged values, the metrics' states) reach
every rank of its pipeline. ``broadcast_object_list`` would pickle them whole: every device tensor
in them copied to the host, and the receivers reading the message's size from a device tensor,
each a host synchronisation on CUDA. :func:`broadcast_results` splits the payload instead: the
tensors on the rank's device go over the device's group as tensors (queued like any collective),
and the rest, a pickle in which each such tensor is a reference, goes over a host group (gloo,
from host memory: the host waits for its peers, never for its device's queue).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

_TensorMeta = tuple[tuple[int, ...], torch.dtype]


class _Pickler(pickle.Pickler):
    """Pickles a payload with each tensor on ``device`` replaced by its index in ``tensors``."""

    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.device = device
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device == self.device:
            self.tensors.append(obj.detach())
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def _broadcast_bytes(data: bytes | None, src: int, group: dist.ProcessGroup) -> bytes:
    """``data`` from ``src`` to every rank of ``group``, in host tensors."""
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if data is not None:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group)
        return data
    buffer = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return buffer.numpy().tobytes()


def broadcast_results(
    payload: Any,
    src: int,
    host_group: dist.ProcessGroup,
    device_group: dist.ProcessGroup,
    device: torch.device,
) -> Any:
    """``payload`` (picklable but for its tensors) from global rank ``src`` to every rank of
    ``device_group`` (``host_group``: the same ranks, taking host tensors); returns it. Its tensors
    on ``device`` arrive there (contiguous, detached), others as pickled."""
    if dist.get_rank() == src:
        file = io.BytesIO()
        pickler = _Pickler(file, device)
        pickler.dump(payload)
        tensors = [t.contiguous() for t in pickler.tensors]
        metas: list[_TensorMeta] = [(tuple(t.shape), t.dtype) for t in tensors]
        _broadcast_bytes(pickle.dumps((file.getvalue(), metas)), src, host_group)
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=device_group)
        return payload
    data, metas = pickle.loads(_broadcast_bytes(None, src, host_group))
    received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
    for tensor in received:
        dist.broadcast(tensor, src=src, group=device_group)
    return _Unpickler(io.BytesIO(data), received).load()
