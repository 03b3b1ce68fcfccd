"""A fully sharded data axis: torch's FSDP2 (``fully_shard``) applied to each stage this rank holds.

With ``shard_parameters=True`` every data-parallel rank keeps 1/dp of its stage's parameters, of
their gradients between steps and of the optimizer state (which follows the parameters: an
optimizer over DTensor shards keeps DTensor state). The sharding is torch's own FSDP2; this module
only decides where its units go and when they gather and reduce, which is what a pipeline changes:

* **Units.** Each pipeline layer is one FSDP unit (layers of one stage that share a parameter
  become one unit: FSDP refuses a parameter in two units), and each stage gets a container,
  :class:`StageRoot`, that applies its layers and is the root of their units: FSDP's per-step
  bookkeeping lives in a root, and a stage is what the executor runs. 0-dim parameters, which
  FSDP2 cannot shard, stay whole on every rank and are averaged by :class:`Gradients
  <lightning_pipe.runtime.gradients.Gradients>` like an unsharded model's.
* **When to gather and reduce** (the ``reshard_after_forward`` choice, torchtitan's naming):

  - ``False`` (the default with a pipeline): a stage's parameters are all-gathered at its first
    forward of the step and kept for every micro-batch, and gradients are reduce-scattered once,
    after the stage's last backward of the accumulation window (torchtitan keeps pipelined stages
    unsharded between micro-batches, "to avoid per-microbatch all-gathers"). FSDP's own hooks
    would reduce at the end of every backward call, and a pipeline makes one per micro-batch (two
    under zero-bubble schedules, whose weight-gradient pass comes after FSDP's hook has fired), so
    the reduction is switched off for the window and triggered by hand, as torch's pipelining
    does (:mod:`.fsdp_internals`). Every gradient is reduced exactly once, whatever the schedule.
  - ``True`` (the default without a pipeline and with a schedule that does not split backward):
    FSDP's ordinary behaviour: each unit frees its gathered parameters after its forward and
    gathers them again for its backward, and each backward reduce-scatters its gradients. The
    least memory (one unit unsharded at a time), ``num_microbatches`` times the communication.

* **Mixed precision**: FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (parameters
  gathered in ``param_dtype``, gradients reduced in float32).
* **Experts** (expert parallelism): each module that holds a block of experts (parameters marked
  with an :class:`~lightning_pipe.experts.shard.ExpertShard`) is an FSDP unit of its own, inside
  its layer's, sharded over the *expert-data* group (the ranks holding the same experts) instead
  of the whole data axis, as torchtitan shards a mixture-of-experts layer's experts. Its gradients
  are divided by the whole data axis's size, not the group's
  (:func:`~lightning_pipe.experts.reduction.expert_gradient_divisor`).

How checkpoints see the sharded state (whole, and cut back on load) is :mod:`.sharded_state`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_pipe.data_parallel import fsdp_internals, returned_views

ApplyLayers = Callable[[Sequence[nn.Module], Any, int], Any]
"""How a stage applies its layers: ``apply(layers, x, stage_index)``."""

_COPIED_ATTRIBUTES = ("tensor_parallel_dim", "expert_shard")
"""Attributes of our parameters (a tensor-parallel slice's dim, the experts a parameter holds)
that FSDP's new ones must keep."""


class ExpertShardingError(ValueError):
    """Expert parameters that cannot be sharded over their expert-data group."""


IsExpertBlock = Callable[[torch.Tensor], bool]
"""Whether a parameter holds a block of experts (the caller reads the mark:
:func:`lightning_pipe.experts.shard.held_block`; this package imports nothing of ``experts``)."""


def expert_modules(layers: Sequence[nn.Module], is_expert: IsExpertBlock | None) -> list[nn.Module]:
    """The modules of ``layers`` that hold blocks of experts as their own parameters: each is
    sharded over the expert-data group. One that holds other parameters too is refused (FSDP
    shards a module's parameters over one group)."""
    if is_expert is None:
        return []
    found = []
    for layer in layers:
        for name, sub in layer.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            experts = [n for n, p in own.items() if is_expert(p)]
            if not experts:
                continue
            others = sorted(set(own) - set(experts))
            if others:
                raise ExpertShardingError(
                    f"The module {name or type(sub).__name__!r} holds blocks of experts ({experts}) and "
                    f"parameters every expert rank holds whole ({others}): shard_parameters=True shards "
                    "a module's parameters over one group, the experts' over the ranks holding the same "
                    "experts. Keep the experts in a module of their own (as Hugging Face's "
                    "`mlp.experts` does), or shard_parameters=False."
                )
            found.append(sub)
    return found


class StageRoot(nn.Module):
    """One pipeline stage as one module: the FSDP root of its layers' units.

    Its children are the stage's layers (so that FSDP finds their units below it); what it applies
    is :attr:`executed`, the layers as the executor runs them (a layer with its own call is wrapped,
    :class:`~lightning_pipe.execution.layers.BoundLayer`), set for each runtime. It is never a
    submodule of the model: the model's names and checkpoints do not change.
    """

    def __init__(self, layers: Sequence[nn.Module], stage_index: int, apply: ApplyLayers) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.stage_index = stage_index
        self._run_layers = apply
        self.executed: list[nn.Module] = list(layers)

    def forward(self, *args: Any) -> Any:
        return self._run_layers(self.executed, args[0] if len(args) == 1 else args, self.stage_index)


def _units(layers: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The stage's layers grouped so that layers sharing a parameter are one group (in order)."""
    groups: list[list[nn.Module]] = []
    owner: dict[int, int] = {}  # id(param) -> group index
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        hit = sorted({owner[i] for i in ids if i in owner})
        if not hit:
            groups.append([layer])
            index = len(groups) - 1
        else:
            index = hit[0]
            groups[index].append(layer)
            for other in reversed(hit[1:]):  # merge the groups this layer joins
                groups[index].extend(groups[other])
                for p_id, g in list(owner.items()):
                    if g == other:
                        owner[p_id] = index
                groups[other] = []
        for i in ids:
            owner[i] = index
    return [g for g in groups if g]


_Attributes = list[tuple[nn.Module, str, dict[str, Any]]]
"""(module, parameter name, attributes): where each attribute must be found again."""


def _attributes(modules: Sequence[nn.Module]) -> _Attributes:
    found = []
    for module in modules:
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                attributes = {a: getattr(p, a) for a in _COPIED_ATTRIBUTES if hasattr(p, a)}
                if attributes:
                    found.append((sub, name, attributes))
    return found


class FullyShardedStages:
    """FSDP2 over the data axis for the stages this rank holds (see the module docstring).

    Args:
        stages: stage index -> its layers (the modules that hold the parameters).
        mesh: the data axis: 1-D (shard), or 2-D ``("dp_replicate", "dp_shard")`` for HSDP.
        apply: how a stage applies its layers.
        reshard_after_forward: ``False``: gathered once per step, reduced once per window;
            ``True``: FSDP's ordinary per-backward behaviour.
        param_dtype: the dtype parameters are gathered and computed in (``None``: their own);
            gradients are then reduced in float32.
        expert_mesh: the expert-data group as a 1-D mesh, over which the modules holding blocks of
            experts are sharded (``None``: no expert axis; blocks of experts are then refused).
        expert_divide_factor: what those modules' summed gradients are divided by
            (:func:`~lightning_pipe.experts.reduction.expert_gradient_divisor`).
        is_expert: which parameters hold a block of experts (``None``: none).
    """

    def __init__(
        self,
        stages: Mapping[int, Sequence[nn.Module]],
        mesh: DeviceMesh,
        apply: ApplyLayers,
        *,
        reshard_after_forward: bool,
        param_dtype: torch.dtype | None = None,
        expert_mesh: DeviceMesh | None = None,
        expert_divide_factor: float | None = None,
        is_expert: IsExpertBlock | None = None,
    ) -> None:
        self.mesh = mesh
        self._is_expert = is_expert
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        """HSDP's replicas (1: every data-parallel rank holds different shards)."""
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
        )
        self.roots: dict[int, StageRoot] = {}
        self.expert_units = 0
        """Modules holding blocks of experts, each an FSDP unit over the expert-data group."""
        unsharded: dict[int, nn.Parameter] = {}
        groups: list[list[nn.Module]] = []
        self._attributes: _Attributes = []
        for s in sorted(stages):
            layers = list(stages[s])
            scalars = {p for layer in layers for p in layer.parameters() if p.dim() == 0}
            unsharded.update({id(p): p for p in scalars if p.requires_grad})
            for group in _units(layers):
                params = [p for layer in group for p in layer.parameters()]
                if not any(p.dim() > 0 for p in params):
                    continue  # nothing to shard (no parameters, or scalars only)
                self._attributes += _attributes(group)
                groups.append(group)
                self._shard_experts(group, expert_mesh, expert_divide_factor, policy)
                fully_shard(
                    group if len(group) > 1 else group[0],
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    mp_policy=policy,
                    ignored_params={p for p in params if p.dim() == 0} or None,
                )
                for module in group:  # FSDP2 hooks the output of each module of a group
                    returned_views.copy_returned_views(module)
            root = StageRoot(layers, s, apply)
            fully_shard(
                root,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
                ignored_params=scalars or None,
            )
            returned_views.copy_returned_views(root)
            fsdp_internals.make_root(root)
            # A parameter without a gradient on some rank (a branch one replica's data skips) would
            # otherwise be left out of that rank's reduce-scatter buffer, misaligning the others'.
            root.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            self.roots[s] = root
        self.restore_attributes()
        self.unsharded: list[nn.Parameter] = list(unsharded.values())
        """Trainable parameters FSDP2 cannot shard (0-dim): whole on every rank, averaged like an
        unsharded model's."""
        self._tracked: list[nn.Parameter] = []
        self._used = torch.zeros(0, dtype=torch.int32)
        self._used_here: list[bool] = []
        self._open = False
        """Whether a window began and has not reduced yet."""
        self._track_use(groups)

    def _shard_experts(
        self,
        group: list[nn.Module],
        expert_mesh: DeviceMesh | None,
        divide_factor: float | None,
        policy: MixedPrecisionPolicy,
    ) -> None:
        """Each module of ``group`` holding blocks of experts: its own unit over ``expert_mesh``
        (before the layer's unit, which then leaves its parameters to it)."""
        modules = expert_modules(group, self._is_expert)
        if not modules:
            return
        if expert_mesh is None or self.replicate_size > 1:
            why = "HSDP (data_parallel_replicate_size > 1)" if expert_mesh is not None else "no expert axis"
            raise ExpertShardingError(
                f"{type(modules[0]).__name__} holds blocks of experts, which shard_parameters=True shards "
                f"over the ranks holding the same experts; with {why} there is no such group. Use "
                "expert_parallel_size > 1 with data_parallel_replicate_size=1, or shard_parameters=False."
            )
        for module in modules:
            fully_shard(
                module, mesh=expert_mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy
            )
            returned_views.copy_returned_views(module)
            if divide_factor is None:
                continue
            unit = _fsdp(module)
            if expert_mesh.size() == 1:
                # One rank holds these experts (dp == E): FSDP2 skips the reduce-scatter and, with
                # a divide factor, divides twice (its pre/post factors, then the factor again in
                # the copy that stands for the collective; torch 2.13). Divide once, here.
                unit.set_gradient_divide_factor(1.0)
                unit.set_all_reduce_hook(functools.partial(_divide, factor=divide_factor))
                continue
            unit.set_gradient_divide_factor(divide_factor)
            # A sum, then a division: gloo has no pre-multiplied sum (NCCL's, one kernel less).
            unit.set_force_sum_reduction_for_comms(True)
        self.expert_units += len(modules)

    def _track_use(self, groups: list[list[nn.Module]]) -> None:
        """Mark which parameters receive a gradient in a window, for :meth:`drop_unused`.

        FSDP reduce-scatters zeros for a parameter that got no gradient on this rank (it must: a
        rank that left it out would misalign the others' buffers), so a parameter that no rank
        used ends the step with a zero gradient, where one device has ``None`` (and an optimizer
        with weight decay or momentum then moves it). Autograd accumulates into the *unsharded*
        parameters, which FSDP keeps as the same objects from one gather to the next: a
        post-accumulate-grad hook on each (the split backward's weight pass goes through
        ``backward`` too) marks it used. They are reached by gathering each unit once, here.
        """
        for group in groups:
            # The layers' unit and the units of their experts inside it (each gathers its own).
            units = [_fsdp(group[0]), *(_fsdp(m) for m in expert_modules(group, self._is_expert))]
            for unit in units:
                unit.unshard()
            gathered = {id(p): p for m in group for p in m.parameters()}
            for unit in units:
                unit.reshard()
            shards = {id(p): p for m in group for p in m.parameters()}
            for whole, shard in zip(gathered.values(), shards.values(), strict=True):
                if shard.requires_grad:
                    self._hook(whole, shard)
        for p in self.unsharded:
            self._hook(p, p)
        self._used = torch.zeros(len(self._tracked), dtype=torch.int32, device=self._used_device())
        self._used_here = [False] * len(self._tracked)
        """The flags as the host saw the hooks run (all set: no read of the reduced flags)."""

    def _used_device(self) -> torch.device:
        return self._tracked[0].device if self._tracked else torch.device("cpu")

    def _hook(self, whole: nn.Parameter, shard: nn.Parameter) -> None:
        index = len(self._tracked)
        self._tracked.append(shard)

        def mark(_: torch.Tensor) -> None:
            self._used[index] = 1
            self._used_here[index] = True

        whole.register_post_accumulate_grad_hook(mark)

    @property
    def deferred(self) -> bool:
        """Whether gradients are reduced once per accumulation window, by :meth:`reduce`."""
        return not self.reshard_after_forward

    def restore_attributes(self) -> None:
        """Put our attributes (a tensor-parallel slice's dim) back on the parameters FSDP made:
        its shards are new parameter objects, and ``nn.Module._apply`` over a unit (moving the model
        to a device) can replace them again."""
        for module, name, attributes in self._attributes:
            param = getattr(module, name)
            for attribute, value in attributes.items():
                setattr(param, attribute, value)

    def set_reshard_after_forward(self, value: bool) -> None:
        """Change when parameters are freed and gradients reduced (a later runtime's choice)."""
        if value != self.reshard_after_forward:
            for root in self.roots.values():
                _fsdp(root).set_reshard_after_forward(value)
            self.reshard_after_forward = value

    def bind(self, stages: Mapping[int, Sequence[nn.Module]]) -> None:
        """The layers as this runtime's executor runs them (wrapped with their calls, if any)."""
        for s, executed in stages.items():
            self.roots[s].executed = list(executed)

    def begin(self) -> None:
        """Start an accumulation window: with deferred reduction, gradients accumulate unsharded
        and the parameters stay gathered until :meth:`reduce`."""
        if self._open:  # the last window never reached its reduction (an exception cut it short)
            for root in self.roots.values():
                fsdp_internals.discard_unreduced(root)
        self._open = True
        self._used.zero_()
        self._used_here = [False] * len(self._tracked)
        if not self.deferred:
            return
        for root in self.roots.values():
            _reduce_at_backward(root, False)

    def reduce(self) -> None:
        """After the window's last backward: reduce every stage's gradients (stages in order, the
        same on every data-parallel rank) and free the gathered parameters."""
        self._open = False
        if not self.deferred:
            return
        for root in self.roots.values():
            _reduce_at_backward(root, True)
            fsdp_internals.reduce_gradients(root)

    def drop_unused(self) -> None:
        """After the window's gradients are reduced: no gradient (``None``) for a parameter that no
        data-parallel rank used in the window, as on one device. Collective over the data axis."""
        if not self._tracked:
            return
        used = self._used.clone()
        for dim in range(self.mesh.ndim):  # HSDP: over the shards, then the replicas
            dist.all_reduce(used, op=dist.ReduceOp.SUM, group=self.mesh.get_group(dim))
        if all(self._used_here):  # used here, so by some rank: the peers may need the sum, not we
            return
        for param, flag in zip(self._tracked, used.tolist(), strict=True):
            if not flag:
                param.grad = None

    def end_evaluation(self) -> None:
        """After a forward-only batch, which never reaches a backward that would: free every
        gathered parameter (parameters read between steps are then the shards the optimizer
        updates) and FSDP's per-forward records (``reset_iter_state``; they would grow with every
        evaluation batch). Gradients a window is accumulating are kept."""
        for root in self.roots.values():
            _fsdp(root).reset_iter_state()

    def shard_group(self) -> Any:
        """The process group over which each rank holds different shards (HSDP: the shard axis)."""
        return self.mesh.get_group(self.mesh.ndim - 1)


def _divide(gradient: torch.Tensor, factor: float) -> None:
    gradient.div_(factor)


def _reduce_at_backward(root: nn.Module, on: bool) -> None:
    """FSDP's per-backward behaviour under ``root``, on or off: whether a backward is the window's
    last, frees the gathered parameters and reduces the gradients."""
    fsdp = _fsdp(root)
    fsdp.set_is_last_backward(on)
    fsdp.set_reshard_after_backward(on)
    fsdp.set_requires_gradient_sync(on)


def _fsdp(root: nn.Module) -> FSDPModule:
    assert isinstance(root, FSDPModule)
    return root
