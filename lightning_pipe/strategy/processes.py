"""The processes of a ``pipe_tp`` run: the first layer of :class:`~.pipe_tp.PipeTPStrategy`.

What Lightning asks of any parallel strategy, answered for a dp x pp x tp layout: the launcher and
the layout checked against the devices before launch, the process group (from Lightning's cluster
environment) with this call's fault board, signal watcher and mesh, the data sharded over the
data axis only (every rank of a pipeline sees the same batch) and ended together, and Lightning's
own collectives (barrier, broadcast, reduce over the data axis), each named when a peer is lost.
The strategy is layered as Lightning layers its own (``ParallelStrategy`` -> ``DDPStrategy``):
this class knows processes and the mesh only; :mod:`.setup` builds the model's pipeline on them
and :mod:`.pipe_tp` runs Lightning's steps, hooks and checkpoints through it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.batches.uneven import EvenBatches
from lightning_pipe.mesh import MeshAxis, NodePlacement, ParallelLayout, ParallelMesh, init_mesh
from lightning_pipe.planning import Constraints, Plan
from lightning_pipe.runtime import RuntimeOptions, prepared_mesh
from lightning_pipe.strategy.auto_layout import NEEDS_MEMORY
from lightning_pipe.strategy.compat import (
    default_backend,
    init_process_group,
    launcher,
    set_rank_zero,
    sync_ddp,
)
from lightning_pipe.strategy.faults import FaultHandling
from lightning_pipe.strategy.options import StrategyOptions, check_layout_fits


class PipeTPProcesses(ParallelStrategy):
    """The processes, the mesh they form and Lightning's collectives over them (see the module
    docstring); the options arrive checked (:func:`~.options.split_arguments`)."""

    def __init__(
        self,
        own: StrategyOptions,
        options: RuntimeOptions,
        auto_constraints: Constraints | None = None,
        **plugins: Any,
    ) -> None:
        # plugins: Lightning's accelerator, devices, cluster environment, checkpoint I/O and
        # precision plugin, as PipeTPStrategy's constructor (which names and types them) received them.
        super().__init__(**plugins)
        self._timeout = cast(timedelta | None, own.timeout)
        self._process_group_backend = own.process_group_backend
        self._start_method = own.start_method
        self._num_nodes = 1
        # The requested sizes ("auto" resolved when the processes exist); every engine option
        # lives once, in the runtime's options (the tensor-parallel plan and the deadline are
        # filled in at setup).
        self.pipeline_parallel_size = own.pipeline_parallel_size
        self.tensor_parallel_size = own.tensor_parallel_size
        self.data_parallel_size = own.data_parallel_size
        self.options = options
        """The engine's options, checked before any process is launched."""
        self.faults = FaultHandling()
        self._mesh: ParallelMesh | None = None
        self._built_mesh: ParallelMesh | None = None
        """The last mesh this strategy built: a later Trainer call with the same layout reuses it."""
        self.max_memory = cast(float | None, own.max_memory)
        self.auto_constraints = auto_constraints
        """Under ``layout="auto"``: the options the user set, kept by the planner (``None``: the
        layout as given)."""
        self.auto_plan: Plan | None = None
        """Under ``layout="auto"``: the plan chosen at the first setup (later Trainer calls keep it)."""

    # ------------------------------------------------------------------ what this rank is
    @property
    def module(self) -> LightningModule:
        """The LightningModule being trained (it is never wrapped under this strategy)."""
        if self.lightning_module is None:
            raise RuntimeError("The pipe_tp strategy has no LightningModule attached yet.")
        return self.lightning_module

    @property
    def layout_pending(self) -> bool:
        """Whether ``layout="auto"`` has yet to choose the sizes (at the strategy's first setup)."""
        return self.auto_constraints is not None and self.auto_plan is None

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            if self.layout_pending:
                raise RuntimeError(
                    "Under layout='auto' the pipe_tp mesh exists once the layout is chosen, at the "
                    "strategy's setup (after configure_model())."
                )
            raise RuntimeError("The pipe_tp mesh exists only after the processes have started.")
        return self._mesh

    @property
    def pp_rank(self) -> int:
        return self.mesh.coordinates.pp_rank

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel replica index: what to shard the data by (with
        :attr:`data_parallel_world_size`). Ranks of one pipeline or tensor group share it, and
        so do the ranks of one context group (they split the same samples' sequences)."""
        return self.mesh.coordinates.dp_rank // self.mesh.layout.context_parallel_size

    @property
    def data_parallel_world_size(self) -> int:
        """The number of data-parallel replicas, each loading its own part of the data (the data
        size over the context size)."""
        return self.mesh.layout.sample_replicas

    def _gather_objects(self, obj: Any) -> dict[int, Any]:
        """``obj`` from every rank of this rank's model replica, by global rank: only the ranks
        sharing a batch learn its roles together (another replica may learn at another step)."""
        if not dist.is_initialized() or self.world_size == 1:
            return {self.global_rank: obj}
        mesh = self.mesh
        ranks = mesh.layout.replica_ranks(mesh.coordinates.dp_rank)
        everyone: list[Any] = [None] * len(ranks)
        others = [r for r in ranks if r != self.global_rank]
        with self.faults.naming("agreeing on which batch tensors the step gives the model", others):
            dist.all_gather_object(everyone, obj, group=mesh.model_group)
        return dict(zip(ranks, everyone, strict=True))

    # ------------------------------------------------------------------ processes
    @property
    def is_distributed(self) -> bool:
        """What Lightning's accelerator connector asks a strategy it does not know: distributed, so
        the training dataloader gets a ``DistributedSampler`` (over the data axis) as under DDP."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank of a pipeline must see the same batch: shard data over the data axis only,
        # whose context groups read the same samples.
        return {"num_replicas": self.data_parallel_world_size, "rank": self.data_parallel_rank}

    @override
    def _configure_launcher(self) -> None:
        """Lightning calls this when the Trainer is built, knowing the devices and nodes but before
        any process is launched: a layout that cannot fit them is refused here, once, in the
        launching process, instead of in every launched rank."""
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = launcher(self, self._start_method)
        sizes = (self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size)
        check_layout_fits(sizes, self.options, self.num_processes, self.num_nodes)
        devices = self.parallel_devices or []
        if self.layout_pending and self.max_memory is None and any(d.type != "cuda" for d in devices):
            raise MisconfigurationException(NEEDS_MEMORY.format(device=devices[0].type))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """The process group (from Lightning's cluster environment), then this call's fault board,
        signal watcher and mesh."""
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero(self.global_rank)
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        init_process_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self.root_device
        )
        if self.layout_pending:
            # layout="auto" decides at setup, once the model exists (configure_model() runs after
            # this): until then the ranks are named as one pipeline, and there is no mesh yet.
            self._mesh = None
            self._start_faults(ParallelLayout.resolve(self.world_size, "auto", 1, "auto"))
            return
        self.start_mesh()

    def start_mesh(self) -> None:
        """The fault board, signal watcher and mesh of the layout's sizes (collective)."""
        layout = ParallelLayout.resolve(
            self.world_size,
            self.pipeline_parallel_size,
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.options.expert_parallel_size,
            self.options.context_parallel_size,
        )
        nodes = self._start_faults(layout)
        kept = self._reusable_mesh(layout)
        if kept is not None:
            # validate / test / predict after fit, or a new Trainer over a prepared model: the
            # same groups, not another set each call (gloo's threads and connections, NCCL's
            # communicators and their device buffers), which nothing would free.
            self._mesh = kept
            return
        try:
            with self.faults.naming(f"creating the process groups of the {layout} mesh"):
                self._mesh = init_mesh(layout, "cuda" if self.root_device.type == "cuda" else "cpu", nodes)
        except ValueError as err:  # a tensor-parallel group across nodes: every rank refuses alike
            raise MisconfigurationException(f"pipe_tp cannot lay out {layout} on its nodes: {err}") from None
        self._built_mesh = self._mesh

    def _reusable_mesh(self, layout: ParallelLayout) -> ParallelMesh | None:
        """The mesh of an earlier call with ``layout`` on this kind of device: the one the module
        was prepared on (its slices and shards use those groups), else the last one this strategy
        built. Every rank finds the same (the same module, the same calls), so none waits in a
        collective."""
        device_type = "cuda" if self.root_device.type == "cuda" else "cpu"  # NCCL, or gloo alone
        module = self.lightning_module
        for mesh in (prepared_mesh(module, layout) if module is not None else None, self._built_mesh):
            if (
                mesh is not None
                and mesh.layout == layout
                and mesh.device_mesh.device_type == device_type
                and mesh.is_live()
            ):
                return mesh
        return None

    def _start_faults(self, layout: ParallelLayout) -> NodePlacement:
        self.faults.start(layout, self.global_rank, self._kill_launched_processes)
        self._mesh = None
        with self.faults.naming("learning which node each rank runs on"):
            nodes = NodePlacement.gather(self.node_rank)
        self.faults.know_nodes(nodes)
        return nodes

    def _kill_launched_processes(self, signum: int) -> None:
        """Record the signal for the other ranks' errors; the processes Lightning's launcher started
        from this one (ranks 1.. under ``popen``) go at once: each would otherwise print its own
        line and wait to lose a peer."""
        self.faults.report_signal(signum)
        if self.launcher is not None:
            self.launcher.kill(9)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make every rank stop at the same batch: a data-parallel replica with fewer batches would
        otherwise leave its peers waiting in a step (see :mod:`lightning_pipe.batches.uneven`)."""
        if self.world_size == 1 or not isinstance(dataloader, Iterable):
            return dataloader
        stage = self.module.trainer.state.stage
        what = f"{stage.dataloader_prefix if stage is not None else ''} batches".strip()
        others = [r for r in range(self.world_size) if r != self.global_rank]
        return EvenBatches(
            dataloader, self.mesh.layout, cast(dist.ProcessGroup, dist.group.WORLD), self.root_device, what,
            warn=rank_zero_warn, naming=lambda action: self.faults.naming(action, others),
        )  # fmt: skip

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        with self.faults.naming(f"waiting for every rank at Lightning's barrier {name!r}"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        with self.faults.naming.lost_peers("receiving an object Lightning broadcasts from rank 0"):
            dist.broadcast_object_list(box, src, group=dist.group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data axis by default: ranks of one pipeline hold the same logged values."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return sync_ddp(tensor, group or self.mesh.group(MeshAxis.DATA), reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = sync_ddp(flag, dist.group.WORLD, "sum")
        return bool(flag == self.world_size) if all else bool(flag)
