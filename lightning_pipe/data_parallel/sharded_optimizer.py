"""ZeRO-1: each data-parallel replica keeps the optimizer state of one slice of its stage.

With Adam in fp32 the optimizer state is twice the parameters, and every replica of a stage used
to hold all of it. As in Megatron-Core's distributed optimizer (and ZeRO stage 1, Rajbhandari et
al. 2020, arXiv:1910.02054), the gradient buckets of :class:`~.reducer.GradientReducer` are cut
into as many equal slices as there are replicas; the reducer *reduce-scatters* each bucket
(still overlapping the last backward), so replica ``k`` receives the averaged gradient of the
``k``-th slice of every bucket, steps only the parameter elements in its slices, and the updated
parameters are all-gathered bucket by bucket in place: launched right after ``optimizer.step()``
(a step post-hook), each waited for by the next forward of the first layer that uses it
(:mod:`.parameter_gather`, which also guards reads in between); a step pre-hook makes a second
step wait for the first's gathers when no forward did.

The user's optimizer object stays the one Lightning, LR schedulers and checkpoints see: its
parameter groups keep their options, but their ``params`` become *pieces*, flat views into this
rank's slices of the real parameters (a parameter cut by a slice boundary gives a piece on each
side). The parameters live in flat per-bucket buffers (:class:`~.parameter_gather.ParameterGather`):
stepping a piece updates the parameter in place, so no second copy of the weights exists.
This is only exact for optimizers whose update is element-wise (per-element state, as SGD with
momentum, Adam, AdamW, RMSprop...): an optimizer that looks at a whole parameter (Adafactor's
factored moments, LAMB's trust ratio, L-BFGS's history) would compute something else on a slice,
so it is refused. torch's ``ZeroRedundancyOptimizer`` is not used: it assigns whole parameters to
ranks (so one large embedding unbalances the shards), relies on a separate all-reduce of every
gradient (no reduce-scatter), and has no notion of our buckets or of tied pipeline copies.

Checkpoints stay keyed by parameter name and unsharded: :meth:`ShardedOptimizer.full_state_dict`
assembles the whole state of this rank's parameters from the replicas (an ordinary
``state_dict()`` numbering), and :meth:`ShardedOptimizer.load_full_state_dict` cuts such a state
into this rank's pieces, so a checkpoint moves between any data-parallel size, with or without
sharding, and one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.data_parallel.parameter_gather import ParameterGather
from lightning_pipe.data_parallel.reducer import BucketLayout

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)
"""Optimizers whose update of an element depends only on that element's gradient and state."""


class ShardingError(ValueError):
    """An optimizer that optimizer-state sharding cannot step exactly."""


@dataclass
class _Piece:
    param: nn.Parameter
    tensor: torch.Tensor
    """A flat view of ``param``'s elements ``[start, stop)``: what the optimizer steps."""
    start: int
    stop: int
    bucket: int
    offset: int
    """Where the piece starts in this rank's slice of its bucket."""

    @property
    def in_shard(self) -> slice:
        """The piece's elements within this rank's slice of its bucket."""
        return slice(self.offset, self.offset + self.stop - self.start)


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step is not element-wise, naming it and the fix. A subclass of
    one of :data:`ELEMENTWISE` is accepted (renaming ``Adam`` or adding a method keeps its step);
    one that overrides ``step`` with a whole-tensor rule is the subclass author's to avoid."""
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(t.__name__ for t in ELEMENTWISE)
        raise ShardingError(
            f"shard_optimizer_state=True steps each replica's slice of the parameters on its own, which is "
            f"exact only for an optimizer whose update is element-wise; {type(optimizer).__name__} is not "
            f"known to be ({names} are). Use one of those, or shard_optimizer_state=False."
        )


class ShardedOptimizer:
    """Turns ``optimizer`` (over this rank's parameters) into a ZeRO-1 optimizer in place.

    Args:
        optimizer: the user's optimizer over this rank's parameters, before its first step.
        layout: the sharding reducer's buckets.
        naming: names the operation in a failing collective's error.
        overlap: launch the parameters' all-gather after the step and let the next forward wait
            for each bucket (``False``: wait for all of it in the step).
        names: parameter names by ``id()``, for the error messages.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: BucketLayout,
        naming: Callable[[str], AbstractContextManager[None]] = lambda what: nullcontext(),
        overlap: bool = True,
        names: Mapping[int, str] | None = None,
    ) -> None:
        check_shardable(optimizer)
        self._naming = naming
        if optimizer.state:
            raise ShardingError(
                f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters; "
                "shard it before its first step (a checkpoint's state is loaded after sharding, cut to "
                "this rank's slices)."
            )
        self.optimizer: torch.optim.Optimizer = optimizer
        self.layout = layout
        # First: the parameters move into their buckets' flat buffers, of which the pieces are views.
        self.gather = ParameterGather(layout, overlap, names, naming)
        self.pieces: dict[int, list[_Piece]] = {}
        for b, bucket in enumerate(layout.buckets):
            own = bucket.shard_range
            for param, offset in bucket.params:
                start, stop = max(own.start, offset), min(own.stop, offset + param.numel())
                if start >= stop:
                    continue
                if not param.is_contiguous():
                    raise ShardingError("Optimizer-state sharding needs contiguous parameters.")
                flat = param.detach().view(-1)
                piece = _Piece(
                    param,
                    flat[start - offset : stop - offset],
                    start - offset,
                    stop - offset,
                    b,
                    start - own.start,
                )
                self.pieces.setdefault(id(param), []).append(piece)
        self.logical_groups: list[list[nn.Parameter]] = []
        for group in optimizer.param_groups:
            self.logical_groups.append(list(group["params"]))
            group["params"] = [piece.tensor for p in group["params"] for piece in self.pieces.get(id(p), [])]
        self._pre_handle = optimizer.register_step_pre_hook(self._before_step)
        self._handle = optimizer.register_step_post_hook(lambda *_: self.gather_parameters())

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Wait for the previous step's gathers before this step writes this replica's slices: an
        in-flight gather still copies them into its own chunk of the buffer, and would overwrite
        part of the update with the old values. With a closure (Lightning's, which runs the whole
        forward and backward), the wait goes after it: its forward is what overlaps the gathers,
        and has waited for all of them by its end, so the wait is then one test."""
        # ``args`` are the step's own: the optimizer first, then a positional closure, if any.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.gather.wait_all()
            return None

        def closure_then_wait() -> Any:
            loss = closure()
            self.gather.wait_all()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    # ------------------------------------------------------------------ one step
    def attach_gradients(self, used: Mapping[int, bool]) -> None:
        """After the reducer's ``finish``: each piece's gradient is its slice of the averaged
        bucket; the full parameters' ``.grad`` (this replica's own, unaveraged) are dropped, so that
        nothing reads them by mistake."""
        self.gather.check_aliasing()  # before the step: a cut-off parameter would miss its update
        for pieces in self.pieces.values():
            for piece in pieces:
                shard = self.layout.buckets[piece.bucket].shard
                piece.tensor.grad = shard[piece.in_shard] if used.get(id(piece.param), True) else None
        for group in self.logical_groups:
            for param in group:
                param.grad = None

    def gather_parameters(self) -> None:
        """All-gather the updated slices into every replica's parameters, in place: launched now,
        in forward order, and waited for by the next forward (or at once without ``overlap``)."""
        self.gather.launch()

    def state_elements(self) -> int:
        """Elements of optimizer state this rank holds (tensors only)."""
        return sum(
            v.numel()
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    # ------------------------------------------------------------------ checkpoints
    def _piece_order(self) -> list[_Piece]:
        return [piece for group in self.logical_groups for p in group for piece in self.pieces.get(id(p), [])]

    def full_state_dict(self) -> dict[str, Any]:
        """The unsharded ``state_dict()`` of this rank's parameters (numbered as the optimizer
        over the real parameters would number them), assembled from every replica's pieces.
        Collective over the group of each bucket (the data-parallel group; under expert
        parallelism the experts' buckets over the ranks holding the same experts)."""
        # Per group the buckets are sharded over (the data axis; under expert parallelism the
        # experts' over the ranks holding the same experts): (param position, start) -> piece state.
        groups = {k: self.layout.group_of(k) for k in range(len(self.layout.buckets))}
        order = list({id(g): g for g in [self.layout.group, *groups.values()]}.values())
        mine: dict[int, dict[tuple[int, int], dict[str, Any]]] = {id(g): {} for g in order}
        position = {id(p): k for k, p in enumerate(p for group in self.logical_groups for p in group)}
        for piece in self._piece_order():
            held = self.optimizer.state.get(piece.tensor)
            if held:
                mine[id(groups[piece.bucket])][(position[id(piece.param)], piece.start)] = {
                    k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in held.items()
                }
        everyone: list[dict[tuple[int, int], dict[str, Any]]] = []
        for group in order:  # the same order on every rank of each group
            parts: list[dict[tuple[int, int], dict[str, Any]]] = [
                {} for _ in range(dist.get_world_size(group))
            ]
            dist.all_gather_object(parts, mine[id(group)], group=group)
            everyone += parts
        params = [p for group in self.logical_groups for p in group]
        state: dict[int, dict[str, Any]] = {}
        for part in everyone:
            for (k, start), entry in part.items():
                param = params[k]
                full = state.setdefault(k, {})
                for key, value in entry.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.dim() == 1
                        and value.numel() > 0
                        and key != "step"
                    ):
                        buffer = full.get(key)
                        if buffer is None:
                            buffer = full[key] = torch.zeros(param.numel(), dtype=value.dtype)
                        buffer[start : start + value.numel()] = value
                    else:
                        full[key] = value
        for k, entry in state.items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.numel() == params[k].numel() and key != "step":
                    entry[key] = value.view_as(params[k]).to(params[k].device)
        groups = self.optimizer.state_dict()["param_groups"]
        numbered, offset = [], 0
        for group, logical in zip(groups, self.logical_groups, strict=True):
            numbered.append({**group, "params": list(range(offset, offset + len(logical)))})
            offset += len(logical)
        return {"state": state, "param_groups": numbered}

    def load_full_state_dict(self, saved: dict[str, Any]) -> None:
        """Load an unsharded state (numbered over the real parameters, as :meth:`full_state_dict`
        gives it) into this rank's pieces."""
        position = {id(p): k for k, p in enumerate(p for group in self.logical_groups for p in group)}
        state: dict[int, dict[str, Any]] = {}
        for index, piece in enumerate(self._piece_order()):
            entry = saved["state"].get(position[id(piece.param)])
            if entry is None:
                continue
            state[index] = {
                key: value.detach().reshape(-1)[piece.start : piece.stop].clone()
                if isinstance(value, torch.Tensor)
                and value.numel() == piece.param.numel()
                and value.numel() > 1
                else value
                for key, value in entry.items()
            }
        current = self.optimizer.state_dict()
        groups = [
            {**theirs, "params": ours["params"]}
            for theirs, ours in zip(saved["param_groups"], current["param_groups"], strict=True)
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


class LogicalOptimizer:
    """The sharded optimizer as checkpoints see it: groups over the real parameters, and the
    unsharded state (assembled once, collectively, on first use); loading cuts into pieces.
    Anything else is the optimizer's own attribute."""

    def __init__(self, sharded: ShardedOptimizer) -> None:
        self._sharded = sharded
        self.param_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": logical}
            for group, logical in zip(sharded.optimizer.param_groups, sharded.logical_groups, strict=True)
        ]
        self._full: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        self._sharded.gather.wait_all()  # a save reads the parameters next: full values
        if self._full is None:
            self._full = self._sharded.full_state_dict()
        return self._full

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        params = [p for group in self.param_groups for p in group["params"]]
        return {params[k]: entry for k, entry in self.state_dict()["state"].items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sharded.load_full_state_dict(state_dict)
        self._full = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sharded.optimizer, name)
