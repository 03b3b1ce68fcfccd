"""What travels between pipeline neighbours, described: an activation (a tensor or a tuple of
tensors of any dtype, whose shapes may change between micro-batches and steps) as an
:class:`ActivationMeta`, and that description encoded as the fixed-size *header* (``int64``: tuple
flag, count, and per tensor its dtype code, whether it requires grad, and its shape) that the
transport (:mod:`.p2p`) sends before the tensors whenever the receiver cannot know their shapes.
Also what NCCL cannot send (:func:`check_sendable`), refused before an exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Wire codes of the dtypes an activation may have. Append only: the code is on the wire.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
HEADER_SIZE = 64
"""Header length in int64 words: room for e.g. 8 tensors of rank 4, or 4 tensors of rank 11."""


def check_sendable(tensor: torch.Tensor, device: torch.device, label: str, index: int) -> None:
    """On CUDA (NCCL) every tensor of an exchange must be on the transport's device (one NCCL
    batch holds tensors of one device) and of a dtype NCCL has (no 16-bit integers); gloo takes
    anything. Checked before the exchange so that the error names the tensor (docs/gpu.md, F5, F6)."""
    if device.type != "cuda":
        return
    if tensor.dtype == torch.int16:
        raise TypeError(
            f"{label}: output tensor {index} is int16, which NCCL cannot send (it has no 16-bit integer "
            "type). Return it as int32 (or another dtype) from the stage's last layer."
        )
    if tensor.device != device:
        raise ValueError(
            f"{label}: output tensor {index} is on {tensor.device}, but the pipeline exchanges tensors on "
            f"{device} (NCCL sends from the rank's device). Create it on the input's device in the "
            "layer (e.g. torch.ones(..., device=x.device))."
        )


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and grad-requirement of one activation tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient travels back for this tensor (floating and requiring grad)."""
        return self.requires_grad and (self.dtype.is_floating_point or self.dtype.is_complex)


@dataclass(frozen=True)
class ActivationMeta:
    """Description of one activation: its tensors and whether it is a tuple."""

    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, value: torch.Tensor | tuple[torch.Tensor, ...]) -> ActivationMeta:
        tensors = value if isinstance(value, tuple) else (value,)
        return cls(
            tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
            isinstance(value, tuple),
        )

    def encode(self) -> torch.Tensor:
        words = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            if t.dtype not in _DTYPE_CODE:
                raise TypeError(f"Cannot send a tensor of dtype {t.dtype} between pipeline stages.")
            words += [_DTYPE_CODE[t.dtype], int(t.requires_grad), len(t.shape), *t.shape]
        if len(words) > HEADER_SIZE:
            raise ValueError(
                f"A stage output of {len(self.tensors)} tensors with shapes "
                f"{[t.shape for t in self.tensors]} does not fit the {HEADER_SIZE}-word pipeline "
                "header; pass fewer or lower-rank tensors between stages (concatenate them)."
            )
        return torch.tensor(words + [0] * (HEADER_SIZE - len(words)), dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> ActivationMeta:
        words = header.tolist()
        is_tuple, count, pos = bool(words[0]), words[1], 2
        tensors = []
        for _ in range(count):
            code, requires_grad, ndim = words[pos : pos + 3]
            shape = tuple(words[pos + 3 : pos + 3 + ndim])
            tensors.append(TensorMeta(shape, _DTYPES[code], bool(requires_grad)))
            pos += 3 + ndim
        return cls(tuple(tensors), is_tuple)
