"""A rank's gradients between the backward passes and the optimizer step.

After the last backward of an accumulation window a rank's gradients are its own replica's, and
a tied parameter's copy holds its own stage's part only. :class:`Gradients` makes them one
device's: the data-parallel reducer averages them over the replicas (overlapping that backward,
bucket by bucket), the copies of every tied parameter are summed across the stages that hold one,
and, under ZeRO-1, each optimizer's pieces take their slices of the averaged buckets. Clipping by
the global norm then sums every element once over the whole model: each stage's and tensor
slice's, a tied parameter on one stage only, a replicated parameter on tensor rank 0 only, and
under ZeRO-1 each replica's slices. With a fully sharded data axis (``shard_parameters``) FSDP2
reduce-scatters instead of the reducer (:mod:`lightning_pipe.data_parallel.fully_sharded`), tied
copies are summed shard by shard, and the norm sums each rank's shards over the shard group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.sharded_optimizer import LogicalOptimizer, ShardedOptimizer, ShardingError
from lightning_pipe.data_parallel.sharded_state import ShardedStateView, is_dtensor, local
from lightning_pipe.experts.shard import expert_shard, held_block
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages

TiedCopy = tuple[nn.Parameter, dist.ProcessGroup, bool]
"""A tied parameter this rank holds: its copy, the group of the ranks holding copies, and whether
this rank counts it in the gradient norm (the first stage that holds it does)."""


class GradientSharding(Enum):
    """How the data-parallel ranks hold a model's gradients and optimizer state."""

    NONE = "none"
    """Every replica holds them whole (the data-parallel reducer averages them), or one replica."""
    OPTIMIZER_STATE = "optimizer_state"
    """ZeRO-1 (``shard_optimizer_state``): each replica keeps its slices of the averaged gradients
    and of the optimizer state."""
    PARAMETERS = "parameters"
    """FSDP2 (``shard_parameters``): each data-parallel rank holds its shards of the parameters,
    gradients and optimizer state."""


def _grad_of(param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient, zeros where it has none (a rank whose micro-batches skipped it)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


class Gradients:
    """This rank's gradients, from the first backward of an accumulation window to the step.

    Args:
        parameters: this rank's trainable parameters.
        tied: the tied parameters this rank holds a copy of.
        mesh: this rank's mesh (the data group averages, the model group sums the norm).
        naming: names this rank and the operation in a failing collective's error.
        bucket_cap_mb: the reducer's bucket size.
        shard: ZeRO-1: each replica keeps the averaged gradient of its slices only.
        summed_over_tensor: parameters kept whole on every tensor rank whose gradient each rank
            computes for its own slice of the input only (a per-head norm): summed over the
            tensor group.
        fully_sharded: FSDP2 over the data axis (``shard_parameters``): it reduces the sharded
            gradients; no reducer then.
        overlap_param_gather: with ``shard``, the updated parameters' all-gather overlaps the next
            forward (:mod:`lightning_pipe.data_parallel.parameter_gather`); ``False``: it blocks
            in the optimizer's step.
    """

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        tied: Sequence[TiedCopy],
        mesh: ParallelMesh,
        naming: CollectiveNaming,
        bucket_cap_mb: float = 25.0,
        shard: bool = False,
        summed_over_tensor: Sequence[nn.Parameter] = (),
        fully_sharded: FullyShardedStages | None = None,
        overlap_param_gather: bool = True,
    ) -> None:
        self.overlap_param_gather = overlap_param_gather
        self.parameters, self.tied, self.mesh, self.naming = list(parameters), list(tied), mesh, naming
        self.summed_over_tensor = list(summed_over_tensor)
        self.fully_sharded = fully_sharded
        self.reducer: GradientReducer | None = None
        self.experts = [p for p in self.parameters if expert_shard(p) is not None]
        """Expert parameters (expert parallelism): reduced over the ranks holding the same experts,
        their norm summed over the expert group."""
        self.expert_reducer: GradientReducer | None = None
        if mesh.layout.data_parallel_size > 1 and fully_sharded is None:
            expert_ids = {id(p) for p in self.experts}
            self.reducer = GradientReducer(
                [p for p in self.parameters if id(p) not in expert_ids],
                mesh.group(MeshAxis.DATA),
                bucket_cap_mb,
                shard=shard,
                late=[p for p, _, _ in self.tied] + self.summed_over_tensor,
            )
            if self.experts:
                # Each expert owner's gradient already sums the tokens of its expert group (the
                # all-to-all's backward): summed over the expert-data group, it covers every data
                # rank's tokens once, divided as the others by the whole data axis's size.
                # Under ZeRO-1 their optimizer state is sharded over that group too: each of its
                # ranks steps a slice of the block of experts they all hold.
                self.expert_reducer = GradientReducer(
                    self.experts,
                    mesh.expert_data_group,
                    bucket_cap_mb,
                    shard=shard,
                    divisor=mesh.layout.data_parallel_size,
                )
        self.sharded: dict[int, ShardedOptimizer] = {}
        """ZeRO-1 optimizers, by ``id()`` of the user's optimizer (at most one)."""

    @property
    def shards(self) -> bool:
        """Whether the optimizer state is sharded over the replicas (ZeRO-1)."""
        return self.reducer is not None and self.reducer.shard

    @property
    def sharding(self) -> GradientSharding:
        """How the data-parallel ranks hold these gradients."""
        if self.fully_sharded is not None:
            return GradientSharding.PARAMETERS
        return GradientSharding.OPTIMIZER_STATE if self.shards else GradientSharding.NONE

    def shard_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        layers: Sequence[nn.Module] = (),
        names: Mapping[int, str] | None = None,
    ) -> None:
        """Make ``optimizer`` step this replica's slices only (ZeRO-1); the updated parameters'
        gathers are waited for by the forward pre-hooks of ``layers`` (this rank's pipeline layers,
        in forward order); ``names``: parameter names by ``id()``, for error messages."""
        if self.reducer is None or not self.reducer.shard:
            return
        if self.sharded:
            # The parameters live in one set of flat bucket buffers, of which the first optimizer's
            # pieces are views; a second would move them again, and gather the first's buckets too.
            (first,) = self.sharded.values()
            raise ShardingError(
                "shard_optimizer_state=True supports one optimizer per model, and this model already has "
                f"one ({type(first.optimizer).__name__}); put every parameter in one "
                "optimizer (parameter groups can hold different options), or shard_optimizer_state=False."
            )
        layout = self.reducer.layout()
        if self.expert_reducer is not None:  # the experts' buckets, over the expert-data group
            layout = layout.join(self.expert_reducer.layout())
        sharded = ShardedOptimizer(optimizer, layout, self.naming, self.overlap_param_gather, names)
        sharded.gather.watch(layers)
        self.sharded[id(optimizer)] = sharded

    def logical(self, optimizer: torch.optim.Optimizer, whole_everywhere: bool = False) -> Any:
        """``optimizer`` as checkpoints see it (``ParallelRuntime.logical``): ZeRO-1's view with
        the unsharded state, FSDP2's with the state gathered whole (on the first replica only,
        unless ``whole_everywhere``), or the optimizer itself."""
        sharded = self.sharded.get(id(optimizer))
        if sharded is not None:
            return LogicalOptimizer(sharded)
        if self.fully_sharded is not None:
            dp_rank = self.mesh.coordinates.dp_rank
            keep = whole_everywhere or dp_rank == 0
            # Blocks of experts are written by the first expert group (every block once).
            experts = whole_everywhere or dp_rank < self.mesh.layout.expert_parallel_size
            # A single-file gather goes on over the tensor group (on NCCL, device tensors only).
            blocks = frozenset(
                id(p) for g in optimizer.param_groups for p in g["params"] if held_block(p) is not None
            )
            return ShardedStateView(
                optimizer, keep_whole=keep, to_host=not whole_everywhere, keep_experts=experts, experts=blocks
            )
        return optimizer

    def wait_for_parameters(self) -> None:
        """Under ZeRO-1, wait for the updated parameters' gathers still in flight: every parameter
        then holds its full value (before anything outside a forward reads them)."""
        for sharded in self.sharded.values():
            sharded.gather.wait_all()

    def abandon_parameter_gathers(self) -> None:
        """After an exception: forget the gathers in flight (a peer may be gone) and stop guarding."""
        for sharded in self.sharded.values():
            sharded.gather.abandon()

    def close(self) -> None:
        """Wait for the gathers in flight and remove the forward pre-hooks."""
        for sharded in self.sharded.values():
            sharded.gather.close()

    def begin(self) -> None:
        """Start an accumulation window (after zeroing the gradients)."""
        for reducer in (self.reducer, self.expert_reducer):
            if reducer is not None:
                reducer.attach()
        if self.fully_sharded is not None:
            self.fully_sharded.begin()

    def arm(self) -> None:
        """The next backward is the window's last: overlap the averaging with it."""
        for reducer in (self.reducer, self.expert_reducer):
            if reducer is not None:
                reducer.arm()

    def finish(self) -> None:
        """Average over the replicas (the reducer's last buckets) and sum tied copies across stages."""

        def sum_tied() -> None:
            with self.naming("summing the gradients of tied parameters across stages"):
                for param, group, _ in self.tied:
                    # Under shard_parameters each copy holds the same rows (same data-parallel
                    # rank, same sharding): the local shards are summed.
                    dist.all_reduce(local(_grad_of(param)), op=dist.ReduceOp.SUM, group=group)
            if self.summed_over_tensor:
                # One flat all-reduce for all of them (norm weights: small and many); in place: a
                # gradient may be a view into the reducer's bucket, which scatters it.
                grads = [local(_grad_of(p)) for p in self.summed_over_tensor]
                flat = torch.cat([g.reshape(-1) for g in grads])
                with self.naming("summing the gradients of replicated_sum parameters over the tensor group"):
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.mesh.group(MeshAxis.TENSOR))
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

        if self.fully_sharded is not None:
            with self.naming("reduce-scattering gradients over the data-parallel group (FSDP2)"):
                self.fully_sharded.reduce()
            unsharded = self.fully_sharded.unsharded  # this rank's trainable 0-dim parameters
            if unsharded:  # 0-dim parameters FSDP2 leaves whole: averaged as without sharding
                grads = [_grad_of(p) for p in unsharded]
                flat = torch.stack([g.reshape(()) for g in grads])
                with self.naming("averaging the gradients of 0-dim parameters over the data-parallel group"):
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.mesh.group(MeshAxis.DATA))
                flat /= self.mesh.layout.data_parallel_size
                for g, value in zip(grads, flat, strict=True):
                    g.copy_(value)
            with self.naming("agreeing which parameters had gradients over the data-parallel group"):
                self.fully_sharded.drop_unused()
            sum_tied()
            return
        if self.reducer is not None and self.reducer.shard:
            # Tied copies sit in different slices on different stages: summed whole, before their
            # (late) buckets are scattered; then each optimizer's pieces take their slices.
            with self.naming("reduce-scattering gradients over the data-parallel group"):
                self.reducer.finish(before_late=sum_tied)
            used = dict(self.reducer.used)
            if self.expert_reducer is not None:
                with self.naming(
                    "reduce-scattering expert gradients over the ranks holding the same experts"
                ):
                    self.expert_reducer.finish()
                used |= self.expert_reducer.used
            for sharded in self.sharded.values():
                sharded.attach_gradients(used)
            return
        if self.reducer is not None:
            with self.naming("averaging gradients over the data-parallel group"):
                self.reducer.finish()
        if self.expert_reducer is not None:
            with self.naming("averaging expert gradients over the ranks holding the same experts"):
                self.expert_reducer.finish()
        sum_tied()

    def clip_(self, max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip by the norm over every stage's and tensor slice's gradients, as one device would
        (``torch.nn.utils.clip_grad_norm_`` over the whole model); returns that norm."""
        # A tied parameter's copies hold the same (summed) gradient: count it on one stage only;
        # a replicated parameter (not sliced across the tensor group) on tensor rank 0 only.
        not_counted = {id(p) for p, _, counts in self.tied if not counts}
        replicas_counted = self.mesh.coordinates.tp_rank == 0
        # Each gradient's squares summed in float32 (in float64 for float64 gradients, as torch's
        # clip_grad_norm_ does), the sums added in float64 (one dtype on every rank).
        local_sum = torch.zeros((), dtype=torch.float64, device=device)
        # Sharded (ZeRO-1), each replica holds its slices' averaged gradients: the norm is summed
        # over the replicas too, each element counted once.
        grads = (
            [
                (piece.param, piece.tensor.grad)
                for sharded in self.sharded.values()
                for pieces in sharded.pieces.values()
                for piece in pieces
            ]
            if self.sharded
            else [(p, p.grad) for p in self.parameters]
        )
        # Under shard_parameters each data-parallel rank holds different shards (DTensor gradients),
        # summed over the shard group too; a gradient FSDP leaves whole (0-dim) is the same on every
        # rank of that group and counted on its first.
        shard_group = self.fully_sharded.shard_group() if self.fully_sharded is not None else None
        whole_counted = shard_group is None or dist.get_rank(shard_group) == 0
        expert_ids = {id(p) for p in self.experts}
        expert_sum = torch.zeros((), dtype=torch.float64, device=device)
        for p, grad in grads:
            if grad is None or id(p) in not_counted:
                continue
            if tensor_parallel_dim(p) is None and not replicas_counted:
                continue
            if shard_group is not None and not is_dtensor(grad) and not whole_counted:
                continue
            g = local(grad).detach()
            squares = (g if g.dtype == torch.float64 else g.float()).pow(2).sum()
            if id(p) in expert_ids:
                expert_sum += squares
            else:
                local_sum += squares
        expert_group = self.mesh.expert_group
        if expert_group is not None and shard_group is None and not self.sharded:
            # Each rank of an expert group holds other experts: each expert counted once. Sharded
            # (ZeRO-1 slices, FSDP2 shards over the expert-data group), the sum over the whole data
            # axis below already meets every expert's pieces once: summing over the expert group
            # first would count each expert E times.
            with self.naming("summing the experts' gradient norm over the expert group"):
                dist.all_reduce(expert_sum, op=dist.ReduceOp.SUM, group=expert_group)
        local_sum += expert_sum
        with self.naming("summing the gradient norm over the model's ranks"):
            dist.all_reduce(local_sum, op=dist.ReduceOp.SUM, group=self.mesh.model_group)
            if self.sharded:
                dist.all_reduce(local_sum, op=dist.ReduceOp.SUM, group=self.mesh.group(MeshAxis.DATA))
            if shard_group is not None:
                dist.all_reduce(local_sum, op=dist.ReduceOp.SUM, group=shard_group)
        total = local_sum.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, grad in grads:
            if grad is not None:
                local(grad).detach().mul_(coef.to(grad.dtype))
        return total if any(p.dtype == torch.float64 for p in self.parameters) else total.float()
