"""What the ranks of one replica agree on around a batch, so that none runs (or stops) alone.

Before a batch runs, every rank of a model replica must hold the same batch, and, the first time
a kind of batch comes, ``forward`` must be the chained layers (under sequence parallelism also the
layers' own check, and a sequence the tensor ranks can split): :class:`StepChecks` checks that
and agrees the finding over the replica, so that every rank stops with one message instead of
some ranks waiting in the schedule for a peer that stopped. After a batch, every rank of the
pipeline receives the last stage's results (:func:`from_last_stage`); where a loop ends, the
replica agrees once more (``ParallelRuntime.agree_end``), so a rank whose data ran out first stops
with its peers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.batches.agreement import (
    PendingAgreement,
    StepCheckError,
    StepIdentity,
    agree,
    fingerprint,
)
from lightning_pipe.batches.forward_contract import check_forward
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.mesh import MeshAxis, ParallelMesh
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.runtime.options import RuntimeOptions
from lightning_pipe.runtime.results_broadcast import broadcast_results
from lightning_pipe.tensor_parallel.regions import sequence_parallel_suspended


class StepChecks:
    """The checks before each batch, and the agreement on them over the model replica.

    Args:
        module: the model (its ``forward`` is checked against the layers).
        executed: every pipeline layer as the executor applies it.
        own_layers: this rank's stages' layers (what the hooks' checks are given).
        mesh, device, naming: this rank's mesh, device and the naming of its collectives.
        options: which checks to run (``check_forward``, ``sequence_parallel``).
        hooks: the model's own checks and the kind of a batch, when it has them.
        fully_sharded: the stages are FSDP2 units (the forward check then gathers over the
            data axis, so every data-parallel rank must run it together).
        warn: shows a once-per-run warning (the forward check may give one).
    """

    def __init__(
        self,
        module: nn.Module,
        executed: Sequence[nn.Module],
        own_layers: Sequence[nn.Module],
        mesh: ParallelMesh,
        device: torch.device,
        naming: CollectiveNaming,
        options: RuntimeOptions,
        hooks: ModelHooks,
        fully_sharded: bool,
        warn: Callable[[str], None],
    ) -> None:
        self.module, self.executed, self.own_layers = module, executed, list(own_layers)
        self.mesh, self.device, self.naming = mesh, device, naming
        self.options, self.hooks, self.fully_sharded, self.warn = options, hooks, fully_sharded, warn
        self.pending: list[PendingAgreement] = []
        """The agreements of the running batch whose values' verdict is not read yet."""
        self.checked_kinds: set[Any] = set()
        """The kinds of first micro-batch (``ModelHooks.probe_kind``; one kind, ``None``, without
        it) whose forward has been checked."""

    @property
    def wants_kind(self) -> bool:
        """Whether :meth:`before` needs the kind of each batch's probe (``ModelHooks.probe_kind``)."""
        return self.options.check_forward and self.hooks.probe_kind is not None

    def before(self, step: StepIdentity, batch: Any, probe: Any, kind: Hashable = None) -> None:
        """Stop every rank of the replica, with one message, if its ranks are about to run
        different batches or (on the first batch of each kind) ``forward`` is not the chained
        layers; ``probe``: the first micro-batch's pipeline input; ``kind``: its kind, when
        :attr:`wants_kind` (read on the host: :func:`~lightning_pipe.runtime.step.host_facts`)."""
        self.pending = []
        problem = None
        run = self.options.check_forward and kind not in self.checked_kinds
        kinds_vary = self.options.check_forward and self.hooks.probe_kind is not None
        if kinds_vary and self.fully_sharded:
            # The check calls the stage's FSDP units, whose gathers are collective over the data
            # axis; replicas meet a new kind of batch at different steps: when one needs the check,
            # every data-parallel rank runs it (again, on its own probe), so the gathers pair up.
            flag = torch.tensor([int(run)], dtype=torch.int32)  # on the host, over its group
            with self.naming("agreeing over the data-parallel group whether to check the forward"):
                dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self.mesh.host_group(MeshAxis.DATA))
            run = bool(flag.item())
        if run:
            self.checked_kinds.add(kind)
            # On the whole probe, without sequence parallelism: what one device computes.
            with sequence_parallel_suspended():
                if self.hooks.check_forward is not None:
                    problem, warning = self.hooks.check_forward(probe, self.own_layers)
                else:
                    problem, warning = check_forward(self.module.forward, self.executed, self.module, probe)
            if warning is not None:
                self.warn(warning)
        tp = self.mesh.layout.tensor_parallel_size
        if problem is None and self.options.sequence_parallel and tp > 1:
            problem = indivisible_sequence(probe, tp)
        self.agree(step, batch, problem, defer=True)
        if run and self.options.sequence_parallel and tp > 1 and self.hooks.check_sequence is not None:
            # After the agreement: every tensor rank holds this batch, so the check's gathers pair up;
            # its finding is agreed on like the others, so that every rank stops with it.
            with self.naming("checking the layers under sequence parallelism (tensor group)"):
                found = self.hooks.check_sequence(probe, self.own_layers, self.mesh.group(MeshAxis.TENSOR))
            self.agree(step, batch, found, defer=True)

    def confirm(self) -> None:
        """Stop every rank of the replica if the running batch's values differ between its ranks:
        the verdict of :meth:`before`'s agreements, read here (once the step's work is queued)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        replica = self.mesh.layout.replica_ranks(self.mesh.coordinates.dp_rank)
        others = [r for r in replica if r != self.mesh.rank]
        with self.naming(f"checking that the replica's ranks ran the same batch ({pending[0].step})", others):
            self._confirm(pending)

    @staticmethod
    def _confirm(pending: list[PendingAgreement]) -> None:
        for agreement in pending:  # two on the first batch of a kind under sequence parallelism
            agreement.confirm()

    def agree(self, step: StepIdentity, batch: Any, problem: str | None = None, defer: bool = False) -> None:
        """Every rank of the replica agrees that it runs ``batch`` at ``step`` and that none found
        a ``problem``; otherwise each raises :class:`StepCheckError` with the one message. With
        ``defer``, the batch's values are compared by :meth:`confirm`."""
        group = self.mesh.model_group
        if dist.get_world_size(group) == 1:
            if problem is not None:
                raise StepCheckError(problem)
            return
        layout = self.mesh.layout

        def describe(rank: int) -> str:
            c = layout.coordinates(rank)
            return f"pp_rank {c.pp_rank}, tp_rank {c.tp_rank}"

        replica = layout.replica_ranks(self.mesh.coordinates.dp_rank)
        others = [r for r in replica if r != self.mesh.rank]
        with self.naming(f"checking that the replica's ranks run the same batch ({step})", others):
            host_group = self.mesh.host_group()
            pending = agree(
                fingerprint(batch, step, self.device),
                group,
                host_group,
                describe,
                step,
                batch,
                problem,
                defer,
            )
        if pending is not None:
            self.pending.append(pending)


def from_last_stage(
    payload: Any,
    mesh: ParallelMesh,
    partition: PipelinePartition,
    device: torch.device,
    naming: CollectiveNaming,
) -> Any:
    """Every rank of this pipeline gets the last stage's ``payload`` (picklable but for its
    tensors: the loss, a head's results), so that all ranks return the same result; its device
    tensors travel as tensors, never read by the host (:mod:`.results_broadcast`)."""
    layout = mesh.layout
    if layout.pipeline_parallel_size == 1:
        return payload
    c = mesh.coordinates
    last = partition.rank_of_stage(partition.num_stages - 1, layout.pipeline_parallel_size)
    src = layout.rank_of(c.dp_rank, last, c.tp_rank)
    peers = [r for r in mesh.pipeline_peers if r != mesh.rank]
    with naming(f"receiving the step's results from the last stage (rank {src})", peers):
        return broadcast_results(
            payload, src, mesh.host_group(MeshAxis.PIPELINE), mesh.group(MeshAxis.PIPELINE), device
        )


def indivisible_sequence(probe: Any, tp: int) -> str | None:
    """Under sequence parallelism, the problem with a first-layer input whose sequence (dim 1 of
    its first tensor of two or more dims) the tensor ranks cannot split evenly, if so."""
    tensors = probe if isinstance(probe, tuple) else (probe,)
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is None or first.shape[1] % tp == 0:
        return None
    return (
        f"sequence_parallel=True splits the sequence over the {tp} tensor ranks, but this batch's sequence "
        f"length is {first.shape[1]}, which {tp} does not divide. Pad the sequences to a multiple of {tp} "
        f"(e.g. pad_to_multiple_of={tp} in the collator), or set sequence_parallel=False."
    )
