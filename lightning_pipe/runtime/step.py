"""Running one batch over the pipeline: split, weigh, check, schedule, finish.

:class:`BatchRunner` is the walk of one batch (``docs/architecture.md``, "The walk of one training
batch", step 3 and 5): it cuts the batch into micro-batches (:mod:`.batch`), weighs each one's
loss by its share of the batch's loss items (:func:`loss_counts`, summed over the replicas when
they average their gradients), has the replica's ranks agree before anything runs
(:class:`~lightning_pipe.runtime.step_checks.StepChecks`), runs the schedule on the executor
(with the BatchNorm deferral around it), finishes the gradients after the accumulation window's
last batch, and hands every rank the last stage's loss and results. Everything it needs for the
runtime's life is given at construction; what varies per batch is given per call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_pipe.batches.agreement import StepIdentity
from lightning_pipe.batches.microbatch import as_layer_arguments, batch_size, signature
from lightning_pipe.execution.batchnorm import DeferredBatchNorm
from lightning_pipe.execution.executor import ActionRecorder, PipelineExecutor
from lightning_pipe.execution.p2p import PipelineCommunicationError
from lightning_pipe.execution.seeding import layer_seed
from lightning_pipe.faults.board import lost_connection
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.batch import (
    BatchResult,
    Head,
    count_microbatches,
    default_pipeline_input,
    split_batch,
    weighted_microbatches,
)
from lightning_pipe.runtime.batch_faults import batch_collectives_named
from lightning_pipe.runtime.context import ContextRun
from lightning_pipe.runtime.gradients import Gradients
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.runtime.options import RuntimeOptions
from lightning_pipe.runtime.step_checks import StepChecks, from_last_stage
from lightning_pipe.schedule.actions import PipelineSchedule
from lightning_pipe.schedule.builders import build_schedule
from lightning_pipe.skip.plan import SkipRoute

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages


class BatchRunner:
    """Runs one batch at a time on this rank (see the module docstring).

    Args:
        mesh, device, naming: this rank's mesh, device and the naming of its collectives.
        options: micro-batches, schedule, layer-seeded dropout.
        hooks: the model's pipeline input and loss items, when it has them.
        partition, stages: the pipeline's stages and those this rank holds.
        skip_routes: the skip connections between stages (the schedules carry their messages).
        executor, gradients, fully_sharded: what runs the schedule and finishes the gradients.
        checks: the agreement before each batch.
        seed: the seed the ranks agreed on (layer-seeded dropout's masks follow from it).
        warn: shows a once-per-run warning.
    """

    def __init__(
        self,
        *,
        mesh: ParallelMesh,
        device: torch.device,
        naming: CollectiveNaming,
        options: RuntimeOptions,
        hooks: ModelHooks,
        partition: PipelinePartition,
        stages: Sequence[int],
        skip_routes: Sequence[SkipRoute],
        executor: PipelineExecutor,
        gradients: Gradients,
        fully_sharded: FullyShardedStages | None,
        checks: StepChecks,
        seed: int,
        warn: Callable[[str], None],
    ) -> None:
        self.mesh, self.device, self.naming, self.options, self.hooks = mesh, device, naming, options, hooks
        self.partition, self.stages, self.skip_routes = partition, tuple(stages), tuple(skip_routes)
        self.executor, self.gradients, self.fully_sharded = executor, gradients, fully_sharded
        self.checks, self.seed, self.warn = checks, seed, warn
        self.pipeline_input = hooks.pipeline_input or default_pipeline_input
        self.context = ContextRun.of(mesh, hooks, self.pipeline_input)
        """With a context axis: the cut of each batch to this rank's part of its sequences."""
        self.schedules: dict[tuple[int, bool], PipelineSchedule] = {}
        self.batches = 0
        """Batches run so far (training and evaluation): the step of a batch run without one."""
        self.warned_small_batch = False

    def schedule_for(self, num_microbatches: int, training: bool) -> PipelineSchedule:
        """The schedule of ``num_microbatches`` micro-batches (forward-only unless ``training``)."""
        key = (num_microbatches, training)
        if key not in self.schedules:
            kind, v = self.options.schedule_kind, self.options.virtual_stages
            pairs = [(r.producer, r.consumer) for r in self.skip_routes]
            self.schedules[key] = build_schedule(
                kind, self.partition.num_stages, *key, virtual_stages=v, skips=pairs
            )
        return self.schedules[key]

    def collectives_named(self) -> AbstractContextManager[None]:
        """A peer lost inside a collective the layers drive (tensor parallelism's, FSDP2's) is
        named like one lost in the runtime's own collectives (:mod:`.batch_faults`)."""
        data = None
        if self.fully_sharded is not None:
            data = dist.get_process_group_ranks(self.mesh.group(MeshAxis.DATA))
        return batch_collectives_named(self.naming, data)

    def layer_seeds(self, training_batch: int) -> Callable[[int, int], list[int]]:
        """The training batch ``training_batch``'s seeds for each layer of a stage on a
        micro-batch (by the layers' global indices: equal for a layer whichever stage and rank
        hold it)."""
        seed, partition = self.seed, self.partition

        def seeds(stage_index: int, microbatch: int) -> list[int]:
            return [
                layer_seed(seed, training_batch, microbatch, k) for k in partition.layer_range(stage_index)
            ]

        return seeds

    def run(
        self,
        batch: Any,
        head: Head,
        training: bool,
        final: bool,
        loss_weight: float,
        step: StepIdentity | None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None,
        recorder: ActionRecorder | None,
        *,
        training_batch: int,
        batch_norm: DeferredBatchNorm | None,
    ) -> BatchResult:
        """Forward (and, ``training``, backward) of ``batch``; ``training_batch``: its index in
        training (layer-seeded dropout); ``batch_norm``: the deferral of BatchNorm statistics."""
        self.batches += 1
        step = step or StepIdentity("train_batch" if training else "eval_batch", self.batches)
        layout = self.mesh.layout
        positions = None
        if self.context is not None:  # before anything counts or splits it: this rank's part
            batch, positions = self.context.cut(batch)
        m, fewer = count_microbatches(batch, self.options.num_microbatches, layout.pipeline_parallel_size)
        if fewer and not self.warned_small_batch:
            self.warned_small_batch = True
            self.warn(
                f"pipe_tp: a batch of {m} samples is smaller than num_microbatches="
                f"{self.options.num_microbatches}; it runs as {m} micro-batches (warned once)."
            )
        sizes, pieces = split_batch(batch, m)
        inputs = [as_layer_arguments(self.pipeline_input(piece)) for piece in pieces]
        items, kind = host_facts(batch, inputs[0], self.hooks, self.checks.wants_kind)
        counts, replica_items, counted = loss_counts(items, sizes, step, training, self.mesh, self.naming)
        local = sum(counts)  # this replica's loss items (or samples)
        if self.context is not None:
            self.context.check_items(counted, training)
        microbatches = weighted_microbatches(pieces, sizes, counts, counted)
        shard = self.context.scope(positions) if self.context and positions is not None else nullcontext()
        with shard:  # the first batch's checks run the layers too (under sequence parallelism)
            self.checks.before(step, batch, inputs[0], kind)
        # By items, the replicas' gradients are averaged, so each replica's losses are weighted by
        # its share of the global batch's items times the number of replicas (1 when the replicas
        # hold as many items each): the average is then the global batch's mean.
        dp_factor = 1.0 if replica_items is None else local * layout.data_parallel_size / replica_items

        def end(output: Any, i: int) -> Any:
            # The loss may read parameters outside the layers (the pre-hooks wait for the layers').
            self.gradients.wait_for_parameters()
            return head(output, microbatches[i])

        first, last = 0 in self.stages, self.partition.num_stages - 1 in self.stages
        deferred = batch_norm if training else None
        if deferred is not None:
            deferred.begin()
        shard = self.context.scope(positions) if self.context and positions is not None else nullcontext()
        try:
            with shard:
                run = self.executor.run(
                    self.schedule_for(m, training),
                    self.mesh.coordinates.pp_rank,
                    inputs=inputs if first else None,
                    head=end if last else None,
                    weights=[mb.share * dp_factor * loss_weight for mb in microbatches] if training else None,
                    signatures=[signature(x) for x in inputs],
                    recorder=recorder,
                    before_last_backward=self.gradients.arm if training and final else None,
                    scale_loss=scale_loss if training else None,
                    layer_seeds=self.layer_seeds(training_batch)
                    if training and self.options.seeds_layers
                    else None,
                )
        except PipelineCommunicationError as err:
            if deferred is not None:
                deferred.end()  # no commit of a failed step's statistics
            if not lost_connection(str(err)):  # a deadline: the peer may wait on a rank that failed
                self.naming.note_first_failure(err)
            raise
        except BaseException:
            if deferred is not None:
                deferred.end()
            raise
        if deferred is not None:  # commit ends the deferral
            dp = layout.data_parallel_size > 1
            with self.naming("summing BatchNorm statistics over the data-parallel group"):
                deferred.commit(self.mesh.group(MeshAxis.DATA) if dp else None)
        if training and self.context is not None:
            self.context.check_attention(self.naming)  # the first batch: before the gradients are used
        if training and final:
            self.gradients.finish()
        if not training and self.fully_sharded is not None:
            self.fully_sharded.end_evaluation()  # no backward frees what the forwards gathered
        payload: dict[str, Any] = {}
        if last:
            if training:  # on the device, in float64 (what summing Python floats did), unread
                payload["loss"] = sum(
                    run.outputs[mb.index].detach().double() * mb.share for mb in microbatches
                )
                if self.context is not None:  # the whole sequences' mean, from the chunks'
                    payload["loss"] = self.context.whole_loss(payload["loss"], local)
            results = getattr(head, "results", None)
            payload["results"] = results() if callable(results) else None
        payload = from_last_stage(payload, self.mesh, self.partition, self.device, self.naming)
        # The replica's batch agreement, read now that the step's work is queued (before any
        # optimizer step could apply a step trained on different batches).
        self.checks.confirm()
        return BatchResult(
            device_loss=payload.get("loss"),
            results=payload.get("results"),
            items=local if counted else None,
            outputs=run.outputs,
            num_microbatches=m,
            peak_stashed=run.peak_stashed,
            peak_activation_bytes=run.peak_activation_bytes,
        )


def host_facts(
    batch: Any, probe: Any, hooks: ModelHooks, wants_kind: bool
) -> tuple[torch.Tensor | None, Hashable]:
    """What the host must know of a batch before its schedule: each sample's loss items (float64
    on the host; ``None`` unless the hooks count items) and, when ``wants_kind``, the kind of its
    first micro-batch's input ``probe``. Values of the device are read at once, in one copy (on
    CUDA each read makes the host wait for the device)."""
    items = hooks.loss_items(batch) if hooks.loss_items is not None else None
    if items is not None:
        total = batch_size(batch)
        if not isinstance(items, torch.Tensor) or tuple(items.shape) != (total,):
            raise ValueError(
                f"loss_items must give one count per sample of the batch (a tensor of shape ({total},)), "
                f"got {tuple(items.shape) if isinstance(items, torch.Tensor) else type(items).__name__}."
            )
        items = items.detach().double()
    kind = hooks.probe_kind(probe) if wants_kind and hooks.probe_kind is not None else None
    flags = kind if isinstance(kind, torch.Tensor) else None
    if flags is not None and items is not None and flags.device == items.device:
        both = torch.cat([items, flags.detach().reshape(-1).double()]).cpu()
        items, flags = both[: items.numel()], both[items.numel() :]
    elif items is not None:
        items = items.cpu()
    if flags is not None:
        kind = tuple(flags.tolist())
    return items, kind


def loss_counts(
    items: torch.Tensor | None,
    sizes: Sequence[int],
    step: StepIdentity,
    training: bool,
    mesh: ParallelMesh,
    naming: CollectiveNaming,
) -> tuple[list[float], float | None, bool]:
    """Each micro-batch's loss items (its samples, unless the hooks count ``items``: float64 on
    the host, per sample), when items are counted and training averages gradients over several
    replicas the global batch's, and whether items were counted."""
    if items is None:
        return [float(n) for n in sizes], None, False
    counts = [float(chunk.sum()) for chunk in torch.split(items, list(sizes))]
    empty = f"The batch of {step} holds no loss items (every label is ignored, e.g. -100 everywhere"
    if mesh.layout.data_parallel_size == 1 or not training:
        if sum(counts) <= 0 and training:
            raise ValueError(
                f"{empty}): its mean loss is undefined, on one device too. Filter such batches out "
                "before they reach the model."
            )
        # Evaluation of a batch without items: weighted by samples (its loss is 0, not 0/0).
        return counts, None, True
    # Summed before any refusal: a replica whose part holds no items must not stop alone while
    # the others wait in this all-reduce; only a global batch without items is refused.
    # Host numbers, summed over the data axis's host group (no wait for the device).
    global_items = torch.tensor([sum(counts)], dtype=torch.float64)
    with naming("summing the batch's loss items over the data-parallel group"):
        dist.all_reduce(global_items, group=mesh.host_group(MeshAxis.DATA))
    if float(global_items) <= 0:
        raise ValueError(
            f"{empty} on every data-parallel replica): its mean loss is undefined, on one device "
            "too. Filter such batches out before they reach the model."
        )
    return counts, float(global_items), True
