"""``ParallelRuntime``: train one model over a dp x pp x tp mesh, in plain torch.

Given a module, its ordered pipeline layers and a :class:`~lightning_pipe.mesh.ParallelMesh`, the
runtime owns everything between "here is a batch's micro-batches" and "the gradients are ready
for ``optimizer.step()``": the pipeline plan, tensor-parallel sharding, tied-weight groups,
materialisation of a meta-built stage, the executor and its schedules, the data-parallel reducer,
deferred BatchNorm, gradient finishing and global-norm clipping. It takes its process groups from
the mesh, imports nothing from Lightning, and is what ``PipeTPStrategy`` adapts Lightning's hooks
onto (issue 17); a training loop without a Trainer drives it directly (``examples/train_engine.py``).

One optimizer step is ``begin_accumulation()`` (after zeroing gradients), then
``step(..., final=...)`` per batch of the accumulation window, then optionally
``clip_grad_norm_()``, then ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.checkpoint.optimizer_view import keep_own
from lightning_pipe.construction.materialize import InitFn
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.data_parallel.reducer import GradientReducer
from lightning_pipe.data_parallel.replicas import broadcast_parameters
from lightning_pipe.data_parallel.sharded_optimizer import LogicalOptimizer, ShardedOptimizer
from lightning_pipe.failures import FailureBoard
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.pipeline.actions import PipelineSchedule
from lightning_pipe.pipeline.batchnorm import DeferredBatchNorm, batch_norm_layers
from lightning_pipe.pipeline.executor import PipelineExecutor, StepResult
from lightning_pipe.pipeline.partition import measures_time
from lightning_pipe.pipeline.plan import PipelinePlan, make_plan
from lightning_pipe.pipeline.profile import profile_layers
from lightning_pipe.pipeline.schedules import build_schedule
from lightning_pipe.runtime import checkpointing
from lightning_pipe.runtime.holdings import Holdings
from lightning_pipe.runtime.options import ConfigurationError, RuntimeOptions
from lightning_pipe.runtime.prepare import (
    Naming,
    Preparation,
    PreparedModel,
    other_stages_tensors,
    prepared_record,
)
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


def _batch_norm_mixes(names: Sequence[str]) -> str:
    """The warning for a pipeline holding BatchNorm layers (``names``) under micro-batching."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"pipe_tp: the model holds BatchNorm layers ({shown}). A pipeline never holds the whole batch in "
        "one place, so in training each one normalises every micro-batch by that micro-batch's own mean and "
        "variance, not the batch's as one device does: losses, gradients and the running statistics of any "
        "BatchNorm whose input changes with them differ from one device's, the more the smaller the "
        "micro-batches (measured with micro-batches of 2 samples: training losses up to 0.6 apart within 18 "
        "steps, a second BatchNorm's running_var up to 25 apart). The running statistics are still "
        "accumulated over the whole batch (deferred batch norm). Fixes: num_microbatches=1 (exact; no "
        "overlap of the stages within a batch), a normalisation that does not mix samples (LayerNorm, "
        "GroupNorm), or BatchNorm layers in eval mode with frozen statistics (as when fine-tuning)."
    )


_SHARDING_ONE_REPLICA = (
    "pipe_tp: shard_optimizer_state=True has no effect with data_parallel_size=1: the optimizer state is "
    "sharded over the data-parallel replicas, and there is one, which keeps all of it. Use "
    "data_parallel_size >= 2 (more processes), or drop the option."
)
_BATCH_NORM_NOT_DEFERRED = (
    "pipe_tp: deferred_batch_norm=False: BatchNorm layers normalise with micro-batch statistics and update "
    "their running statistics once per micro-batch, unlike one device."
)


def _no_naming(what: str, peers: Sequence[int] = ()) -> AbstractContextManager[None]:
    return nullcontext()


class ParallelRuntime:
    """dp x pp x tp training of ``module`` on this rank (see the module docstring).

    Args:
        module: the whole model (built eagerly, or with meta parameters).
        layers: its pipeline layers in order (submodules of ``module``).
        mesh: this rank's mesh; every group is taken from it.
        device: where this rank's stage lives.
        options: schedule, partition, recomputation, tensor-parallel plan, ...
        seed: the seed of a meta-built model's initial values and of tensor-parallel dropout;
            global rank 0's is used on every rank (``None``: its ``torch.initial_seed()``).
        init: called for each module with tensors to initialise instead of its
            ``reset_parameters()`` (meta-built models).
        weights: pretrained files a meta-built model starts from.
        naming: ``naming(what, peers)``, a context that adds who and what to a collective's error.
        sample: one micro-batch's pipeline input (what the first layer takes), which
            ``partition="time"`` times the layers on; not needed otherwise.
        board: the job's failure board: an exchange that loses its peer names who stopped and why.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Sequence[nn.Module],
        mesh: ParallelMesh,
        device: torch.device,
        options: RuntimeOptions | None = None,
        *,
        seed: int | None = None,
        init: InitFn | None = None,
        weights: WeightFiles | None = None,
        naming: Naming = _no_naming,
        sample: Any = None,
        board: FailureBoard | None = None,
    ) -> None:
        self.module, self.mesh, self.device = module, mesh, device
        self.options = options or RuntimeOptions()
        self._naming = naming
        layout = mesh.layout
        v = self.options.virtual_stages
        record = prepared_record(module, layout, self.options.partition, v)
        self.first_setup = record is None
        materialized: frozenset[int] = frozenset()
        if record is None and v > 1 and len(layers) < layout.pipeline_parallel_size * v:
            raise ConfigurationError(
                f"The model has {len(layers)} pipeline layers but interleaved 1F1B asks for "
                f"pipeline_parallel_size ({layout.pipeline_parallel_size}) x virtual_stages ({v}) = "
                f"{layout.pipeline_parallel_size * v} stages, each needing at least one layer. Lower "
                "virtual_stages or pipeline_parallel_size, or return finer-grained layers from "
                "configure_pipeline()."
            )
        times = self._layer_times(layers, sample) if record is None else None
        plan = (
            make_plan(module, layers, layout.pipeline_parallel_size * v, self.options.partition, times)
            if record is None
            else record.plan
        )
        self.stage_indices = plan.stages_of_rank(mesh.coordinates.pp_rank, layout.pipeline_parallel_size)
        """The stages this rank holds; every stage-dependent choice reads this."""
        tied = self._tied_groups(plan)  # collective (new_group): before the seed's broadcast
        self.warnings: list[str] = []
        """Once-per-run warnings for the caller to show (rank 0 suffices: every rank has them)."""
        if record is None:
            seed = self._agreed_seed(seed)
            preparation = Preparation(
                module, mesh, device, self.options, seed, init, weights, naming, tied, self.stage_indices
            )
            record, materialized = preparation.run(plan, layers)
            self.warnings += preparation.warnings
        self.record: PreparedModel = record
        self.plan: PipelinePlan = plan
        self.layers: list[nn.Module] = [module.get_submodule(name) for name in self.plan.layer_names]
        own = [self.layers[i] for s in self.stage_indices for i in self.plan.layer_range(s)]
        owned = {id(p): p for layer in own for p in layer.parameters() if p.requires_grad}
        self.parameters: list[nn.Parameter] = list(owned.values())
        """This rank's trainable parameters (its stages' layers, tensor slices included)."""
        self.executor = PipelineExecutor(
            {s: [self.layers[i] for i in self.plan.layer_range(s)] for s in self.stage_indices},
            self.plan.num_stages,
            mesh.pipeline_peers,
            device,
            self.options.recomputation,
            timeout=self.options.timeout,
            check_finite=self.options.check_finite,
            board=board,
        )
        self._schedules: dict[tuple[int, bool], PipelineSchedule] = {}
        self.reducer: GradientReducer | None = None
        if layout.data_parallel_size > 1:
            c = mesh.coordinates
            src = layout.rank_of(0, c.pp_rank, c.tp_rank)
            # Materialised tensors are equal on every replica by construction: not sent again.
            tensors = [t for layer in own for t in (*layer.parameters(), *layer.buffers())]
            with naming("making the replicas' weights equal"):
                broadcast_parameters(
                    [t for t in tensors if id(t) not in materialized], mesh.group(MeshAxis.DATA), src
                )
        self.tied: list[tuple[nn.Parameter, dist.ProcessGroup, bool]] = [
            (module.get_parameter(record.tied_paths.get(name, name)), group, counts)
            for name, group, counts in tied
        ]
        if layout.data_parallel_size > 1:
            self.reducer = GradientReducer(
                self.parameters,
                mesh.group(MeshAxis.DATA),
                self.options.bucket_cap_mb,
                shard=self.options.shard_optimizer_state,
                late=[p for p, _, _ in self.tied],
            )
        self.sharded: dict[int, ShardedOptimizer] = {}
        """ZeRO-1 optimizers (``shard_optimizer_state``), by ``id()`` of the user's optimizer."""
        if self.options.shard_optimizer_state and layout.data_parallel_size == 1 and self.first_setup:
            self.warnings.append(_SHARDING_ONE_REPLICA)
        self.batch_norm: DeferredBatchNorm | None = None
        if batch_norm_layers(self.layers):
            if self.options.deferred_batch_norm:
                self.batch_norm = DeferredBatchNorm(batch_norm_layers(own))
                if self.options.num_microbatches != 1:  # one micro-batch: the batch's statistics
                    names = {id(m): n for n, m in module.named_modules()}
                    held = [names[id(m)] for m in batch_norm_layers(self.layers)]
                    self.warnings.append(_batch_norm_mixes(held))
            else:
                self.warnings.append(_BATCH_NORM_NOT_DEFERRED)

    # ------------------------------------------------------------------ what this rank holds
    @property
    def holdings(self) -> Holdings:
        assert self.record.holdings is not None
        return self.record.holdings

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.plan.num_stages - 1 in self.stage_indices

    def other_stages_tensors(self) -> set[int]:
        """``id()`` of the tensors only other ranks' stages hold (meta, or never trained here)."""
        return other_stages_tensors(self.plan, self.layers, self.stage_indices)

    def keep_own(self, optimizer: OptimizerT) -> OptimizerT:
        """``optimizer``, built over the whole module's parameters (other stages' meta tensors
        included, as ``model.parameters()`` gives them), keeping only this rank's; its groups stay
        described in whole-model terms, so that its checkpoints load at any layout and on one
        device (:mod:`lightning_pipe.checkpoint.optimizer_view`). Returns it."""
        others = self.other_stages_tensors()
        own = {id(p) for p in self.module.parameters() if id(p) not in others and not p.is_meta}
        keep_own(optimizer, self.module, own)
        if self.reducer is not None and self.reducer.shard:
            self.sharded[id(optimizer)] = ShardedOptimizer(optimizer, self.reducer, self._naming)
        return optimizer

    def logical(self, optimizer: torch.optim.Optimizer) -> Any:
        """``optimizer`` as checkpoints see it (under ``shard_optimizer_state``, a view over the
        real parameters with the unsharded state: assembling it is collective over the replicas)."""
        sharded = self.sharded.get(id(optimizer))
        return optimizer if sharded is None else LogicalOptimizer(sharded)

    def describe(self, num_microbatches: int | None) -> str:
        """The start-of-run layout log."""
        layout, record = self.mesh.layout, self.record
        per_rank = self.holdings.per_rank if layout.tensor_parallel_size > 1 else None
        m = num_microbatches or f"auto (2 x {layout.pipeline_parallel_size})"
        v = self.options.virtual_stages
        virtual = f" ({v} stages per rank)" if v > 1 else ""
        text = (
            f"pipe_tp: layout {layout} (world {layout.world_size}), schedule "
            f"{self.options.schedule_kind.value}{virtual}, micro-batches {m}, checkpoint "
            f"{self.executor.checkpoint.value}\n"
            + self.plan.describe(self.layers, per_rank, layout.pipeline_parallel_size)
        )
        if record.sharding:
            text += f"\n{record.sharding}"
        if self.options.shard_optimizer_state:
            dp = layout.data_parallel_size
            text += (
                f"\n  optimizer state sharded over the {dp} data-parallel replicas (ZeRO-1)"
                if dp > 1
                else "\n  shard_optimizer_state=True has no effect: one data-parallel replica holds all state"
            )
        if record.built_on_meta:
            text += (
                "\n  built on the meta device: each rank holds only its own stages' tensors (and tensor "
                "slices); other stages' parameters are meta tensors, without storage"
            )
        return text

    def _layer_times(self, layers: Sequence[nn.Module], sample: Any) -> list[float] | None:
        """Every layer's forward + backward seconds per micro-batch, measured by global rank 0 and
        sent to every rank (``partition="time"``; ``None`` for other partitions)."""
        if not measures_time(self.options.partition):
            return None
        if sample is None:
            raise ConfigurationError(
                'partition="time" times each layer on a sample micro-batch, and none was given: pass '
                "`sample=` (one micro-batch's pipeline input) to ParallelRuntime, or, under Lightning, set "
                "`self.example_input_array` in the LightningModule to a batch of forward's input."
            )
        # Global rank 0 measures alone while the others wait: ranks sharing cores (or a host)
        # would skew each other's timings, and everyone must compute the same split anyway.
        totals = torch.zeros(len(layers), dtype=torch.float64, device=self.device)
        if self.mesh.rank == 0:
            totals = torch.tensor(
                [t.total for t in profile_layers(layers, sample, self.device)],
                dtype=torch.float64,
                device=self.device,
            )
        with self._naming("sending the measured layer times from global rank 0"):
            c = self.mesh.coordinates
            if c.dp_rank == 0:  # rank 0's replica first, then each replica from its dp_rank 0 twin
                dist.broadcast(totals, src=0, group=self.mesh.model_group)
            if self.mesh.layout.data_parallel_size > 1:
                src = self.mesh.layout.rank_of(0, c.pp_rank, c.tp_rank)
                dist.broadcast(totals, src=src, group=self.mesh.group(MeshAxis.DATA))
        return totals.tolist()

    # ------------------------------------------------------------------ one step
    def schedule(self, num_microbatches: int, training: bool) -> PipelineSchedule:
        key = (num_microbatches, training)
        if key not in self._schedules:
            kind, v = self.options.schedule_kind, self.options.virtual_stages
            self._schedules[key] = build_schedule(kind, self.plan.num_stages, *key, virtual_stages=v)
        return self._schedules[key]

    def begin_accumulation(self) -> None:
        """Start an optimizer step's accumulation window (call after zeroing the gradients)."""
        if self.reducer is not None:
            self.reducer.attach()

    def step(
        self,
        num_microbatches: int,
        inputs: Sequence[Any] | None = None,
        head: Callable[[Any, int], Any] | None = None,
        *,
        training: bool = True,
        final: bool = True,
        weights: Sequence[float] | None = None,
        signatures: Sequence[Any] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> StepResult:
        """Run one schedule over a batch's micro-batches on this rank.

        ``inputs`` are needed where stage 0 lives, ``head`` (the loss, when training) where the
        last stage lives. ``final``: the last batch of the accumulation window; its backward
        overlaps the data-parallel all-reduce, and the gradients are finished after it.
        ``scale_loss``: applied to each weighted loss before its backward (fp16: a gradient
        scaler's ``scale``; unscale with :class:`~lightning_pipe.runtime.grad_scaler.AgreedGradScaler`
        so that every rank skips or steps together).
        """
        executor = self.executor
        executor.scale_loss = scale_loss if training else None
        executor.before_last_backward = self.reducer.arm if training and final and self.reducer else None
        deferred = self.batch_norm if training else None
        if deferred is not None:
            deferred.begin()
        try:
            result = executor.run(
                self.schedule(num_microbatches, training),
                self.mesh.coordinates.pp_rank,
                inputs=inputs if self.holds_first_stage else None,
                head=head if self.holds_last_stage else None,
                weights=weights,
                signatures=signatures,
            )
        except BaseException:
            if deferred is not None:
                deferred.end()  # no commit of a failed step's statistics
            raise
        if deferred is not None:  # commit ends the deferral
            dp = self.mesh.layout.data_parallel_size > 1
            with self._naming("summing BatchNorm statistics over the data-parallel group"):
                deferred.commit(self.mesh.group(MeshAxis.DATA) if dp else None)
        if training and final:
            self.finish_gradients()
        return result

    def finish_gradients(self) -> None:
        """Average over the replicas (the reducer's last buckets) and sum tied copies across stages."""

        def sum_tied() -> None:
            with self._naming("summing the gradients of tied parameters across stages"):
                for param, group, _ in self.tied:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)

        if self.reducer is not None and self.reducer.shard:
            # Tied copies sit in different slices on different stages: summed whole, before their
            # (late) buckets are scattered; then each optimizer's pieces take their slices.
            with self._naming("reduce-scattering gradients over the data-parallel group"):
                self.reducer.finish(before_late=sum_tied)
            for sharded in self.sharded.values():
                sharded.attach_gradients()
            return
        if self.reducer is not None:
            with self._naming("averaging gradients over the data-parallel group"):
                self.reducer.finish()
        sum_tied()

    def from_last_stage(self, payload: Any) -> Any:
        """Every rank of this pipeline gets the last stage's ``payload`` (any picklable object:
        the step's loss, logged values, predictions), so that all ranks return the same result."""
        layout = self.mesh.layout
        if layout.pipeline_parallel_size == 1:
            return payload
        c = self.mesh.coordinates
        last = self.plan.rank_of_stage(self.plan.num_stages - 1, layout.pipeline_parallel_size)
        src = layout.rank_of(c.dp_rank, last, c.tp_rank)
        box = [payload]
        device = self.device if self.device.type == "cuda" else None
        peers = [r for r in self.mesh.pipeline_peers if r != self.mesh.rank]
        with self._naming(f"receiving the step's results from the last stage (rank {src})", peers):
            dist.broadcast_object_list(box, src=src, group=self.mesh.group(MeshAxis.PIPELINE), device=device)
        return box[0]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's and tensor slice's gradients, as one device would
        (``torch.nn.utils.clip_grad_norm_`` over the whole model); returns that norm."""
        # A tied parameter's copies hold the same (summed) gradient: count it on one stage only;
        # a replicated parameter (not sharded across the tensor group) on tensor rank 0 only.
        not_counted = {id(p) for p, _, counts in self.tied if not counts}
        replicas_counted = self.mesh.coordinates.tp_rank == 0
        local = torch.zeros((), dtype=torch.float32, device=self.device)
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
        for p, grad in grads:
            if grad is None or id(p) in not_counted:
                continue
            if tensor_parallel_dim(p) is None and not replicas_counted:
                continue
            local += grad.detach().float().pow(2).sum()
        with self._naming("summing the gradient norm over the model's ranks"):
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.mesh.model_group)
            if self.sharded:
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.mesh.group(MeshAxis.DATA))
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, grad in grads:
            if grad is not None:
                grad.detach().mul_(coef.to(grad.dtype))
        return total

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: str | Path,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Collective over the world: write this rank's part of the model and of each optimizer
        (and, from global rank 0, ``extra``) into the sharded checkpoint directory ``path``,
        keyed by the unsharded model's names, so that any layout, or one device after
        ``python -m lightning_pipe.consolidate``, loads it."""
        checkpoint = {
            **(extra or {}),
            "state_dict": checkpointing.model_state(self),
            "optimizer_states": [checkpointing.optimizer_state(self, o) for o in optimizers],
        }
        with self._naming(f"saving the checkpoint {path}"):
            checkpointing.write(self, path, checkpoint, is_writer=self.mesh.rank == 0)

    def load_checkpoint(
        self, path: str | Path, optimizers: Sequence[torch.optim.Optimizer] = (), strict: bool = True
    ) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``path`` (any layout's) into the model and
        ``optimizers``; returns the rest of it (what ``extra`` held when it was saved)."""
        checkpoint = checkpointing.read(self, path, optimizers, strict)
        checkpointing.load_model(self, checkpoint, strict)
        if optimizers:
            checkpointing.load_optimizers(self, checkpoint, optimizers)
        for key in ("state_dict", "optimizer_states", checkpointing.SHARDED):
            checkpoint.pop(key, None)
        return checkpoint

    def close(self) -> None:
        """Remove the hooks this runtime installed (BatchNorm deferral)."""
        if self.batch_norm is not None:
            self.batch_norm.remove()
            self.batch_norm = None

    # ------------------------------------------------------------------ construction helpers
    def _agreed_seed(self, seed: int | None) -> int:
        """Global rank 0's seed (given, or its ``torch.initial_seed()``), on every rank: ranks
        whose environments differ (a seed set on some ranks only, or per rank) still build one model."""
        mine = seed if seed is not None else torch.initial_seed()
        value = torch.tensor([mine % 2**62], dtype=torch.int64, device=self.device)
        with self._naming("agreeing on the seed of the initial weights"):
            dist.broadcast(value, src=0)
        return int(value)

    def _tied_groups(self, plan: PipelinePlan) -> list[tuple[str, dist.ProcessGroup, bool]]:
        """For each tied parameter this rank holds: its name, the group of its copies' ranks, and
        whether this rank counts it in the gradient norm (the first stage does)."""
        layout, held = self.mesh.layout, self.stage_indices
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # new_group is collective: every rank creates every group, in the same order.
        for stages in sorted({stages for _, stages in plan.tied}):
            # The ranks holding those stages (one rank may hold several of them).
            pp_ranks = sorted({plan.rank_of_stage(s, layout.pipeline_parallel_size) for s in stages})
            for dp in range(layout.data_parallel_size):
                for tp in range(layout.tensor_parallel_size):
                    ranks = [layout.rank_of(dp, r, tp) for r in pp_ranks]
                    group = dist.new_group(ranks)
                    if self.mesh.rank in ranks:
                        groups[stages] = group
        return [
            (name, groups[stages], stages[0] in held)
            for name, stages in plan.tied
            if any(s in held for s in stages)
        ]
