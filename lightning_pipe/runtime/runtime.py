"""``ParallelRuntime``: train one model over a dp x pp x tp mesh, in plain torch.

Given a module, its ordered pipeline layers and a :class:`~lightning_pipe.mesh.ParallelMesh`, the
runtime owns everything between "here is a batch" and "the gradients are ready for
``optimizer.step()``", imports nothing from Lightning, and takes its process groups from the mesh;
``PipeTPStrategy`` adapts Lightning's hooks onto it, and a loop without a Trainer drives it
directly (``examples/train_engine.py``).

The facade: its methods are the API both callers use (in the class docstring), each delegating to the
module of the concept: what a runtime is built of (:mod:`.build`), one batch (:mod:`.step`), its agreement
(:mod:`.step_checks`), micro-batches (:mod:`.batch`), gradients (:mod:`.gradients`), the layout log.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lightning_pipe.batches.agreement import StepIdentity
from lightning_pipe.checkpoint import rank_state
from lightning_pipe.checkpoint.optimizer_view import keep_own
from lightning_pipe.construction.materialize import InitFn
from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.execution.batchnorm import DeferredBatchNorm
from lightning_pipe.execution.executor import ActionRecorder
from lightning_pipe.faults.board import FaultBoard
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import ParallelMesh
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.batch import BatchResult, Head
from lightning_pipe.runtime.build import build, own_layers
from lightning_pipe.runtime.gradients import GradientSharding
from lightning_pipe.runtime.holdings import Holdings
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.runtime.layout_log import describe_layout
from lightning_pipe.runtime.model_recompute import ModelCheckpointing, take_over_late
from lightning_pipe.runtime.options import RuntimeOptions
from lightning_pipe.runtime.prepare import Preparation, other_stages_tensors
from lightning_pipe.runtime.step import BatchRunner
from lightning_pipe.runtime.step_checks import StepChecks
from lightning_pipe.schedule.actions import PipelineSchedule

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


class ParallelRuntime:
    """dp x pp x tp training of ``module`` on this rank (see the module docstring).

    What the adapter (and a loop without a Trainer) may call; anything else is internal:

    * construction: ``ParallelRuntime(module, layers, mesh, device, options, *, seed, init,
      weights, sample, example_input, board, hooks, trains)``;
    * one optimizer step: :meth:`begin_accumulation` (after zeroing the gradients), then
      :meth:`train_batch` per batch of the accumulation window (``final=True`` on the last), then
      optionally :meth:`clip_grad_norm_`, then ``optimizer.step()``;
    * evaluation: :meth:`eval_batch` per batch; :meth:`agree_end` where a loop ends, so that a
      rank whose data ran out first stops with its peers;
    * optimizers: :meth:`keep_own` (the optimizer built over the whole model keeps this rank's
      parameters; ZeRO-1 shards it), :meth:`logical` (what checkpoints see),
      :meth:`wait_for_parameters` (ZeRO-1's gathers in flight), :attr:`gradient_sharding` (how
      the data-parallel ranks hold gradients and optimizer state);
    * checkpoints: :meth:`save_checkpoint`, :meth:`load_checkpoint`, and :attr:`part` for
      callers that compose their own (:mod:`lightning_pipe.checkpoint.rank_state`);
    * what this rank holds: :attr:`module`, :attr:`mesh`, :attr:`device`, :attr:`partition`,
      :attr:`stage_indices`, :attr:`holds_first_stage`, :attr:`holds_last_stage`,
      :attr:`layers`, :attr:`own_layers`, :attr:`parameters`, :attr:`holdings`,
      :meth:`other_stages_tensors`, :meth:`schedule_for`, :attr:`first_setup`,
      :attr:`training_batches`, :attr:`naming`, :meth:`describe`, :attr:`warnings`;
    * around the run: :meth:`after_model_moved` (the caller moved the model, e.g. back from the
      host after a teardown), :meth:`abandon_pending_work` (after an exception, where a peer may
      be gone), :meth:`close` at the end of a run.

    The parts it keeps (``options``, ``hooks``, ``preparation``, ``model_checkpointing``,
    ``skip_routes``, ``executor``, ``gradients``, ``fully_sharded``, ``batch_norm``; see
    :class:`~lightning_pipe.runtime.build.Built`) stay readable for tests and diagnostics, but
    are not part of that API.

    Args:
        module: the whole model (built eagerly, or with meta parameters).
        layers: its pipeline layers in order (submodules of ``module``).
        mesh: this rank's mesh; every group is taken from it.
        device: where this rank's stage lives.
        options: micro-batches, schedule, partition, recomputation, tensor-parallel plan, ...
        seed: the seed of a meta-built model's initial values and of tensor-parallel dropout;
            global rank 0's is used on every rank (``None``: its ``torch.initial_seed()``).
        init: called for each module with tensors to initialise instead of its
            ``reset_parameters()`` (meta-built models).
        weights: pretrained files a meta-built model starts from.
        sample: one micro-batch's pipeline input (what the first layer takes), which
            ``partition="time"`` times the layers on; not needed otherwise.
        example_input: instead of ``sample``, a batch of ``forward``'s input (Lightning's
            ``example_input_array``): ``sample`` is then its first micro-batch, through the
            hooks' ``pipeline_input`` (:func:`~lightning_pipe.runtime.batch.sample_microbatch`).
        board: the job's fault board: a collective or exchange that loses its peer names who
            stopped and how.
        hooks: how to read a model that is more than its layers chained (what enters the first
            layer, how each layer is called, how ``forward`` is checked, the loss items of each
            sample); see :class:`~lightning_pipe.runtime.hooks.ModelHooks`.
        trains: whether this runtime will train (``False``: evaluation only, where what only
            training does unlike one device, BatchNorm under micro-batching, is not refused).
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
        sample: Any = None,
        example_input: Any = None,
        board: FaultBoard | None = None,
        hooks: ModelHooks | None = None,
        trains: bool = True,
    ) -> None:
        self.module, self.mesh, self.device = module, mesh, device
        self.naming = CollectiveNaming(mesh.rank, str(mesh.coordinates), board)
        """Names this rank and the operation in a failing collective's error (the caller may use
        it for its own collectives)."""
        self.hooks = hooks or ModelHooks()
        built = build(
            module, layers, mesh, device, options or RuntimeOptions(), self.naming, self.hooks,
            seed=seed, init=init, weights=weights, sample=sample, example_input=example_input,
            board=board, trains=trains,
        )  # fmt: skip
        # The parts built, each documented on Built.
        self.options = built.options
        self.first_setup = built.first_setup
        self.model_checkpointing: ModelCheckpointing | None = built.model_checkpointing
        self._asked_recompute = built.asked_recompute
        self.warnings: list[str] = built.warnings
        self.partition: PipelinePartition = built.partition
        self.stage_indices = built.stage_indices
        self.preparation: Preparation = built.preparation
        self.layers: list[nn.Module] = built.layers
        self._executed = built.executed
        self.skip_routes = built.skip_routes
        self.fully_sharded: FullyShardedStages | None = built.fully_sharded
        self.parameters: list[nn.Parameter] = built.parameters
        self.executor = built.executor
        self.gradients = built.gradients
        self.batch_norm: DeferredBatchNorm | None = built.batch_norm
        for text in self.warnings:
            self._warn(text)
        self._checks = StepChecks(
            module, self._executed, self.own_layers, mesh, device, self.naming, self.options, self.hooks,
            self.fully_sharded is not None, self._warn,
        )  # fmt: skip
        self._runner = BatchRunner(
            mesh=mesh, device=device, naming=self.naming, options=self.options, hooks=self.hooks,
            partition=self.partition, stages=self.stage_indices, skip_routes=self.skip_routes,
            executor=self.executor, gradients=self.gradients, fully_sharded=self.fully_sharded,
            checks=self._checks, seed=self.preparation.seed, warn=self._warn,
        )  # fmt: skip
        self._late_checkpointing_checked = False
        self.training_batches = 0
        """Training batches run so far: the batch key of layer-seeded dropout when ``train_batch``
        is given none (the Lightning adapter gives the loop's count, which a resumed run restores)."""

    # ------------------------------------------------------------------ what this rank holds
    @property
    def own_layers(self) -> list[nn.Module]:
        """The pipeline layers of the stages this rank holds, in order."""
        return own_layers(self.layers, self.partition, self.stage_indices)

    @property
    def holdings(self) -> Holdings:
        """Whole and per-rank parameter elements of every stage."""
        assert self.preparation.holdings is not None
        return self.preparation.holdings

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.partition.num_stages - 1 in self.stage_indices

    @property
    def part(self) -> rank_state.RankPart:
        """What this rank holds, as checkpoints see it."""
        return rank_state.RankPart(
            self.module,
            self.partition,
            self.stage_indices,
            self.mesh.layout,
            self.mesh.coordinates,
            frozenset(id(p) for p in self.parameters),
            is_writer=self.mesh.rank == 0,
        )

    def other_stages_tensors(self) -> set[int]:
        """``id()`` of the tensors only other ranks' stages hold (meta, or never trained here)."""
        return other_stages_tensors(self.partition, self.layers, self.stage_indices)

    def keep_own(self, optimizer: OptimizerT) -> OptimizerT:
        """``optimizer``, built over the whole module's parameters, keeping only this rank's (its
        groups still described in whole-model terms: :mod:`lightning_pipe.checkpoint.optimizer_view`);
        under ``shard_optimizer_state`` it then steps this replica's slices only. Returns it."""
        others = self.other_stages_tensors()
        own = {id(p) for p in self.module.parameters() if id(p) not in others and not p.is_meta}
        keep_own(optimizer, self.module, own)
        # The modules the executor calls (a layer with its call, BoundLayer) hold the layers' parameters.
        executed = [self._executed[i] for s in self.stage_indices for i in self.partition.layer_range(s)]
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.gradients.shard_optimizer(optimizer, executed, names)
        return optimizer

    def wait_for_parameters(self) -> None:
        """Under ZeRO-1, wait for the parameters' all-gathers still in flight after the step; call it
        before reading weights through an alias made before the step or from another thread (the
        read guard sees neither); safe from any thread. Nothing to do otherwise."""
        self.gradients.wait_for_parameters()

    def logical(self, optimizer: torch.optim.Optimizer, *, whole_everywhere: bool = False) -> Any:
        """``optimizer`` as checkpoints see it: under ``shard_optimizer_state``, a view over the
        real parameters with the unsharded state (assembling it is collective over the replicas);
        under ``shard_parameters``, a view whose state is gathered whole (collective over the data
        axis) on the first replica only, or on every rank with ``whole_everywhere`` (a single-file
        checkpoint's gather)."""
        return self.gradients.logical(optimizer, whole_everywhere)

    def describe(self, num_microbatches: int | None = None) -> str:
        """The start-of-run layout log."""
        return describe_layout(
            self.module, self.mesh.layout, self.options, self.preparation, self.partition, self.layers,
            self.skip_routes, self.fully_sharded, self.executor.recompute, self.model_checkpointing,
            self._asked_recompute, num_microbatches, self.mesh.nodes,
        )  # fmt: skip

    @property
    def gradient_sharding(self) -> GradientSharding:
        """How the data-parallel ranks hold the gradients and optimizer state: whole
        (``NONE``), ZeRO-1's slices (``OPTIMIZER_STATE``) or FSDP2's shards (``PARAMETERS``)."""
        return self.gradients.sharding

    def after_model_moved(self) -> None:
        """Call after moving the model (``module._apply``), e.g. back to the device after a
        teardown moved it to the host: FSDP2's stages take back the attributes the move reset."""
        if self.fully_sharded is not None:
            self.fully_sharded.restore_attributes()

    def abandon_pending_work(self) -> None:
        """After an exception: forget ZeRO-1's parameter gathers in flight (a peer may be gone, so
        waiting could last the whole timeout) and stop guarding reads of the parameters."""
        self.gradients.abandon_parameter_gathers()

    # ------------------------------------------------------------------ one step
    def schedule_for(self, num_microbatches: int, training: bool) -> PipelineSchedule:
        """The schedule of ``num_microbatches`` micro-batches (forward-only unless ``training``)."""
        return self._runner.schedule_for(num_microbatches, training)

    def begin_accumulation(self) -> None:
        """Start an optimizer step's accumulation window (call after zeroing the gradients)."""
        self.gradients.begin()

    def train_batch(
        self,
        batch: Any,
        head: Head,
        *,
        final: bool = True,
        loss_weight: float = 1.0,
        step: StepIdentity | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        recorder: ActionRecorder | None = None,
        training_batch: int | None = None,
    ) -> BatchResult:
        """Forward and backward of ``batch`` over the pipeline; its gradients accumulate.

        Args:
            batch: the whole batch, the same on every rank of the replica (checked).
            head: on the last stage, ``head(output, microbatch)`` returns the micro-batch's scalar
                loss; a ``head.results()`` method's return reaches every rank (:class:`BatchResult`).
            final: the last batch of the accumulation window: its backward overlaps the
                data-parallel averaging, and the gradients are finished after it.
            loss_weight: the batch's share of the window's loss (``1 / accumulation``); each
                micro-batch's loss is weighted by its share of the batch's samples times this.
            step: which step this is, for the messages of the batch agreement.
            scale_loss: applied to each weighted loss before its backward (fp16: a gradient
                scaler's ``scale``; unscale with
                :class:`~lightning_pipe.runtime.grad_scaler.AgreedGradScaler`).
            recorder: the timeline's hook for this batch's actions.
            training_batch: the batch's index in training (over epochs): with layer-seeded
                dropout, its masks follow from it (default: :attr:`training_batches`).
        """
        if training_batch is not None:
            self.training_batches = training_batch
        if not self._late_checkpointing_checked:
            self._late_checkpointing_checked = True
            self._take_over_late_checkpointing()
        try:
            with self._runner.collectives_named():
                return self._runner.run(
                    batch, head, True, final, loss_weight, step, scale_loss, recorder,
                    training_batch=self.training_batches, batch_norm=self.batch_norm,
                )  # fmt: skip
        finally:
            self.training_batches += 1

    def eval_batch(
        self,
        batch: Any,
        head: Head,
        *,
        step: StepIdentity | None = None,
        recorder: ActionRecorder | None = None,
    ) -> BatchResult:
        """Forward of ``batch`` over the pipeline; ``head(output, microbatch)`` runs on the last
        stage (its returns are the result's ``outputs`` there)."""
        with self._runner.collectives_named():
            return self._runner.run(
                batch, head, False, False, 1.0, step, None, recorder,
                training_batch=self.training_batches, batch_norm=self.batch_norm,
            )  # fmt: skip

    def agree_end(self, what: str) -> None:
        """Where a loop ends (``"end of validation"``): every rank of the replica agrees, so that a
        rank whose data ran out first stops with its peers instead of leaving them in a step."""
        self._checks.agree(StepIdentity(what, -1), None)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's and tensor slice's gradients, as one device would
        (``torch.nn.utils.clip_grad_norm_`` over the whole model); returns that norm."""
        return self.gradients.clip_(max_norm, self.device)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: str | Path,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Collective over the world: write this rank's part of the model and of each optimizer
        (and, from global rank 0, ``extra``) into the checkpoint directory ``path``, keyed by the
        unsliced model's names, so that any layout, or one device after
        ``python -m lightning_pipe.consolidate``, loads it."""
        self.wait_for_parameters()
        part = self.part
        checkpoint = {
            **(extra or {}),
            "state_dict": rank_state.model_state(part),
            "optimizer_states": [rank_state.optimizer_state(part, self.logical(o)) for o in optimizers],
        }
        with self.naming(f"saving the checkpoint {path}"):
            rank_state.write(part, path, checkpoint)

    def load_checkpoint(
        self, path: str | Path, optimizers: Sequence[torch.optim.Optimizer] = (), strict: bool = True
    ) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``path`` (any layout's) into the model and
        ``optimizers``; returns the rest of it (what ``extra`` held when it was saved)."""
        part, views = self.part, [self.logical(o) for o in optimizers]
        checkpoint = rank_state.read(part, path, views, strict)
        rank_state.load_model(part, checkpoint, strict)
        if optimizers:
            rank_state.load_optimizers(part, checkpoint, views)
        for key in ("state_dict", "optimizer_states", rank_state.FROM_DIRECTORY):
            checkpoint.pop(key, None)
        return checkpoint

    def close(self) -> None:
        """Remove the hooks this runtime installed (BatchNorm deferral, ZeRO-1's waits for the
        parameters' gathers, after waiting for those in flight)."""
        self.gradients.close()
        if self.batch_norm is not None:
            self.batch_norm.remove()
            self.batch_norm = None

    # ------------------------------------------------------------------ construction helpers
    def _take_over_late_checkpointing(self) -> None:
        """The model's own gradient checkpointing, turned on after setup (in a hook before the first
        training batch): taken over as at setup, and said, since the layout log is already out."""
        taken = take_over_late(self.module, self.layers, self.model_checkpointing)
        if taken is None:
            return
        self.model_checkpointing = self.preparation.model_checkpointing = taken
        self.executor.recompute = taken.mode(self.executor.recompute)
        self._warn(
            f"pipe_tp: the model's gradient checkpointing was turned on after setup; recompute "
            f"{self.executor.recompute.value}{taken.describe(self._asked_recompute)}"
        )

    def _warn(self, text: str) -> None:
        """A once-per-run warning, shown by global rank 0 for the job."""
        if self.mesh.rank == 0:
            warnings.warn(text, UserWarning, stacklevel=3)
