"""Split a model's experts over an expert group, from an expert-parallel plan.

The plan maps module-name patterns to styles, as Hugging Face's ``base_model_ep_plan`` does
(names inside the module trained, ``*`` for one name component):

* ``"ep_dispatch_experts"`` on an experts module: a module holding every expert of one layer,
  called as ``experts(hidden [tokens, hidden], top_k_index [tokens, top_k], top_k_weights
  [tokens, top_k])`` and returning the weighted sum per token, with an ``int`` attribute
  ``num_experts`` (the Hugging Face convention for fused experts). Its forward is replaced, in a
  subclass made once per class (state-dict names unchanged), by dispatch -> its own forward on
  the local block (``num_experts`` set to the local count, indices into the block, weight 1) ->
  combine (:mod:`.dispatch`). The router that produced the indices and weights is not touched.
* ``"grouped_gemm"`` on a parameter of such a module (``experts.gate_up_proj``, and the biases
  of families that have them): stacked along dim 0 by expert, cut to this rank's block and
  marked with its :class:`~.shard.ExpertShard`.

Every parameter of an experts module must be named by a ``grouped_gemm`` entry (one left whole
would be computed by every rank for different tokens: refused). Only the modules inside this
rank's own pipeline layers are cut. A meta-built module is cut before it has values: the cut
keeps its source (the full meta module), so materialising initialises the full experts and keeps
this rank's block (:mod:`lightning_pipe.tensor_parallel.sources`), as tensor-parallel slices are.

The experts stay whole inside a tensor group: every tensor rank of a stage holds the same block
and dispatches within its own expert group (the expert groups are made of the data ranks of one
``(pp_rank, tp_rank)``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.arguments import divisors
from lightning_pipe.experts.dispatch import DispatchStats, ExpertGroup, dispatch_combine
from lightning_pipe.experts.shard import ExpertShard, mark_expert_shard
from lightning_pipe.tensor_parallel.plan import pattern_regex
from lightning_pipe.tensor_parallel.sources import record_source

_STATE = "_lightning_pipe_experts"


class ExpertStyle(enum.Enum):
    """The styles of an expert-parallel plan (Hugging Face's names)."""

    DISPATCH = "ep_dispatch_experts"
    GROUPED_GEMM = "grouped_gemm"


class ExpertPlanError(ValueError):
    """An expert-parallel plan that cannot be applied to the model as given."""


@dataclass
class ExpertSharding:
    """What :func:`shard_experts` did on this rank."""

    modules: list[str] = field(default_factory=list)
    """The experts modules cut (this rank's stages)."""
    num_experts: dict[str, int] = field(default_factory=dict)
    """Experts per cut module."""
    stats: DispatchStats = field(default_factory=DispatchStats)
    """Rows the dispatches of this rank have moved (shared by its modules)."""

    def describe(self, expert_parallel_size: int) -> str:
        if not self.modules:
            return ""
        counts = sorted(set(self.num_experts.values()))
        per_rank = ", ".join(f"{n // expert_parallel_size} of {n}" for n in counts)
        return (
            f"  experts: {len(self.modules)} mixture-of-experts layers on this rank's stages split over "
            f"expert groups of {expert_parallel_size} data ranks ({per_rank} experts per rank; routers "
            "and shared experts whole on every data rank)"
        )


@dataclass
class _Dispatch:
    group: ExpertGroup
    stats: DispatchStats


def _styles(plan: Mapping[str, str]) -> list[tuple[str, ExpertStyle]]:
    parsed = []
    for pattern, style in plan.items():
        try:
            parsed.append((pattern, ExpertStyle(style)))
        except ValueError:
            known = [s.value for s in ExpertStyle]
            raise ExpertPlanError(
                f"The expert-parallel plan gives {pattern!r} the style {style!r}, which pipe_tp does not "
                f"implement (it knows {known})."
            ) from None
    return parsed


def expert_modules(module: nn.Module, plan: Mapping[str, str]) -> list[str]:
    """The names of the experts modules (``ep_dispatch_experts``) the plan matches in ``module``."""
    regexes = [pattern_regex(p) for p, s in _styles(plan) if s is ExpertStyle.DISPATCH]
    return [n for n, _ in module.named_modules() if n and any(r.fullmatch(n) for r in regexes)]


def check_expert_counts(
    module: nn.Module, plan: Mapping[str, str], expert_parallel_size: int
) -> dict[str, int]:
    """Each experts module's expert count, after checking that ``expert_parallel_size`` divides it
    (an error naming the module, its count and the sizes that would)."""
    counts = {}
    for name in expert_modules(module, plan):
        experts = module.get_submodule(name)
        n = getattr(experts, "num_experts", None)
        if not isinstance(n, int) or n < 1:
            raise ExpertPlanError(
                f"{name} ({type(experts).__name__}) is an 'ep_dispatch_experts' module without an integer "
                "num_experts attribute, so pipe_tp cannot tell how many experts it holds."
            )
        if n % expert_parallel_size != 0:
            raise ExpertPlanError(
                f"expert_parallel_size={expert_parallel_size} does not divide the {n} experts of {name}: "
                f"each rank of an expert group holds an equal block. Use one of {divisors(n)} (dividing the "
                "data-parallel size too)."
            )
        counts[name] = n
    return counts


def shard_experts(
    module: nn.Module,
    plan: Mapping[str, str],
    own_layers: Sequence[nn.Module],
    group: dist.ProcessGroup,
    expert_parallel_size: int,
    ep_rank: int,
) -> ExpertSharding:
    """Cut every experts module of ``plan`` inside ``own_layers`` to this rank's block of experts
    and make it dispatch over ``group``; see the module docstring."""
    parsed = _styles(plan)
    counts = check_expert_counts(module, plan, expert_parallel_size)
    gemm = [pattern_regex(p) for p, s in parsed if s is ExpertStyle.GROUPED_GEMM]
    owned = {id(m) for layer in own_layers for m in layer.modules()}
    done = ExpertSharding()
    for name, n in counts.items():
        experts = module.get_submodule(name)
        if id(experts) not in owned:
            continue
        cut = [
            attr
            for attr, _ in experts.named_parameters(recurse=False)
            if any(r.fullmatch(f"{name}.{attr}") for r in gemm)
        ]
        whole = [attr for attr, _ in experts.named_parameters() if attr not in cut]
        if whole:
            raise ExpertPlanError(
                f"{name} ({type(experts).__name__}) holds parameters the expert-parallel plan does not "
                f"split by expert ({whole}); pipe_tp cannot dispatch it (each rank would compute them for "
                "other tokens). Use expert_parallel_size=1 for this model."
            )
        if not cut:
            raise ExpertPlanError(
                f"{name} ({type(experts).__name__}): the expert-parallel plan names no 'grouped_gemm' "
                "parameter of it, so pipe_tp cannot split its experts. Use expert_parallel_size=1."
            )
        for attr in cut:
            param = experts.get_parameter(attr)
            if param.dim() == 0 or param.shape[0] != n:
                raise ExpertPlanError(
                    f"{name}.{attr} has shape {tuple(param.shape)}, not {n} experts stacked along dim 0; "
                    "pipe_tp cannot split it by expert. Use expert_parallel_size=1 for this model."
                )
        shard = ExpertShard(n, ep_rank * (n // expert_parallel_size), n // expert_parallel_size)
        on_meta = any(experts.get_parameter(a).is_meta for a in cut)
        full = _shallow_copy(experts) if on_meta else None
        _cut(experts, cut, shard)
        if full is not None:
            record_source(experts, full, _cutter(cut, shard))
        experts.__dict__[_STATE] = _Dispatch(ExpertGroup(group, expert_parallel_size, ep_rank, n), done.stats)
        experts.__dict__["num_experts"] = shard.local_experts
        experts.__class__ = _dispatching(type(experts))
        done.modules.append(name)
        done.num_experts[name] = n
    return done


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A module object of the same class sharing ``module``'s tensors, with its own registries."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    for registry in ("_parameters", "_buffers", "_modules"):
        copy.__dict__[registry] = dict(module.__dict__[registry])
    return copy


def _cutter(cut: Sequence[str], shard: ExpertShard) -> Callable[[nn.Module], nn.Module]:
    """Cuts a copy of a full experts module as :func:`_cut` cut the module itself."""

    def build(full: nn.Module) -> nn.Module:
        return _cut(_shallow_copy(full), cut, shard)

    return build


def _cut(experts: nn.Module, cut: Sequence[str], shard: ExpertShard) -> nn.Module:
    """Replace each parameter of ``cut`` by its block ``shard`` (dim 0), marked."""
    block = slice(shard.first_expert, shard.first_expert + shard.local_experts)
    for attr in cut:
        param = experts.get_parameter(attr)
        with torch.no_grad():
            kept = nn.Parameter(param.detach()[block].clone(), requires_grad=param.requires_grad)
        mark_expert_shard(kept, shard)
        setattr(experts, attr, kept)
    return experts


_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _dispatching(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its forward as dispatch -> ``cls.forward`` on the local block -> combine."""
    if getattr(cls, "_lightning_pipe_dispatches", False):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:

        def forward(
            self: nn.Module,
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
            *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:
            state: _Dispatch = self.__dict__[_STATE]

            def local(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
                ones = torch.ones(index.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
                return cls.forward(self, rows, index.unsqueeze(-1), ones, *args, **kwargs)

            params = [p for p in self.parameters(recurse=False) if p.requires_grad]
            return dispatch_combine(
                hidden_states, top_k_index, top_k_weights, state.group, local, params, state.stats
            )

        sub = type(
            cls.__name__,
            (cls,),
            {
                "forward": forward,
                "_lightning_pipe_dispatches": True,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
        _SUBCLASSES[cls] = sub
    return sub


def dispatch_stats(module: nn.Module) -> DispatchStats | None:
    """The rows moved by the dispatches of ``module``'s cut experts modules (shared), if any."""
    for m in module.modules():
        state = m.__dict__.get(_STATE)
        if isinstance(state, _Dispatch):
            return state.stats
    return None
