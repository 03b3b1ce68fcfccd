"""FSDP2-sharded state as checkpoints and gradient arithmetic see it: whole, or this rank's shard.

Under ``shard_parameters=True`` (:mod:`.fully_sharded`) parameters, gradients and the optimizer's
state are DTensor shards over the data axis. A checkpoint holds them whole, as one device would:
saving gathers each value (only a writer keeps it), loading cuts a whole value back into this
rank's shard. These conversions, and :class:`ShardedStateView`, the optimizer as checkpoints see
it (the FSDP2 counterpart of ZeRO-1's :class:`~.sharded_optimizer.LogicalOptimizer`), are apart
from the FSDP wiring because they touch only tensors, never the units, roots or hooks that
:class:`~.fully_sharded.FullyShardedStages` sets up.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# DTensor is imported where a DTensor is made (FSDP2, ``fully_sharded``), not here: importing
# ``torch.distributed.tensor`` costs about a second, which every rank would pay on importing the
# engine, sharded or not.
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing DTensor: where its module was never
    imported (the class lives in it), no DTensor can exist."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``tensor`` (its shard, for a DTensor)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full(value: Any) -> Any:
    """``value`` whole: a DTensor gathered (collective over its mesh), anything else as it is."""
    return value.full_tensor() if is_dtensor(value) else value


def gather_whole(value: Any, keep: bool, to_host: bool) -> Any:
    """``value`` gathered whole where this rank ``keep``s it (moved to the host with ``to_host``),
    else its own shard back: a collective over a DTensor's mesh either way, so that only a writer
    ever holds a whole stage. Anything but a DTensor as it is."""
    if not is_dtensor(value):
        return value
    whole = value.full_tensor()
    if not keep:
        return value
    return whole.cpu() if to_host else whole


def shard_like(value: Any, current: Any) -> Any:
    """A whole ``value`` cut like ``current`` (a DTensor shard: this rank's rows, no
    communication); anything else as it is."""
    if is_dtensor(current) and isinstance(value, torch.Tensor) and not is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor

        if tuple(value.shape) != tuple(current.shape):
            return value  # not shaped like it (a scalar step count): the caller decides
        return distribute_tensor(
            value.to(current.device), current.device_mesh, current.placements, src_data_rank=None
        )
    return value


class ShardedStateView:
    """An optimizer over DTensor shards as checkpoints see it: its state whole (every parameter's
    state gathered from the data-parallel ranks, a collective over them), and loading a whole state
    cuts each rank's shard. Anything else is the optimizer's own attribute.

    Args:
        optimizer: the optimizer over this rank's (sharded) parameters.
        keep_whole: whether this rank keeps the gathered values; a rank that writes nothing takes
            part in each gather and keeps its shards, so that no rank but the writer ever holds
            its stage's whole optimizer state.
        to_host: move each gathered value to the host at once (a checkpoint directory's writer:
            the stage's whole state never sits on the device).
        keep_experts: ``keep_whole`` for the state of the parameters in ``experts`` (``id()`` of
            those holding blocks of experts, whose writers are the first expert group, not the
            first replica); ``None``: ``keep_whole``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        keep_whole: bool = True,
        to_host: bool = False,
        keep_experts: bool | None = None,
        experts: frozenset[int] = frozenset(),
    ) -> None:
        self._optimizer = optimizer
        self._experts = experts
        self._keep_whole = keep_whole
        self._keep_experts = keep_whole if keep_experts is None else keep_experts
        self._to_host = to_host
        self._saved: dict[str, Any] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    def _whole(self, value: Any, param: torch.Tensor) -> Any:
        keep = self._keep_experts if id(param) in self._experts else self._keep_whole
        return gather_whole(value, keep, self._to_host)

    def state_dict(self) -> dict[str, Any]:
        """The whole state, gathered once per view (a save reads it more than once)."""
        if self._saved is None:
            saved = self._optimizer.state_dict()
            params = [p for group in self.param_groups for p in group["params"]]
            state = {
                i: {k: self._whole(v, params[i]) for k, v in e.items()} for i, e in saved["state"].items()
            }
            self._saved = {"state": state, "param_groups": saved["param_groups"]}
        return self._saved

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        params = [p for group in self.param_groups for p in group["params"]]
        return {params[i]: entry for i, entry in self.state_dict()["state"].items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        saved = state_dict["state"]
        state = {i: {k: shard_like(v, params[i]) for k, v in entry.items()} for i, entry in saved.items()}
        self._optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._saved = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
