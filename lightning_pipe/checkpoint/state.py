"""Which model and optimizer state each rank saves, and how a rank re-cuts saved state on load.

Saving: a rank writes the state-dict keys of its pipeline stage (the module's keys outside every
pipeline layer go with stage 0, unless they alias a layer's tensor), its own slice of each
tensor-parallel parameter and, on tensor rank 0 only, the replicated ones; only the first
data-parallel replica writes. Under expert parallelism the first replica is the first expert group:
each of its ranks writes its block of every parameter marked with an
:class:`~lightning_pipe.experts.shard.ExpertShard` (recorded by global expert index), and the rest
only from ``ep_rank`` 0. The optimizer state of a parameter is written by the stage that
writes the parameter itself (for a tied parameter, the stage of its first name), keyed by parameter
name rather than by position.

Loading: a rank takes the keys its stage holds in the *current* layout, asks the reader for each
full value (of an expert parameter, the experts it holds) and cuts the slice its tensor rank needs.
The same cutting serves plain single-file checkpoints, which hold full tensors already. Every
mismatch (a missing or unexpected key, a shape, an optimizer whose parameters differ) is reported
before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_pipe.checkpoint.metadata import CheckpointError, TensorEntry
from lightning_pipe.checkpoint.optimizer_view import local_groups, whole_groups, whole_model_names
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.experts.shard import held_block
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.tensor_parallel.layers import tensor_parallel_dim

_SHOWN = 8  # names listed in an error before "and N more"


Stages = int | Collection[int]
"""The stage indices a rank holds (one, or several), as :meth:`PipelinePartition.stages_of_rank`
gives them."""


def _stage_set(stages: Stages) -> frozenset[int]:
    return frozenset((stages,)) if isinstance(stages, int) else frozenset(stages)


def holds_key(partition: PipelinePartition, key: str, stages: Stages) -> bool:
    """Whether a rank holding ``stages`` uses the state-dict entry ``key``: its owner's stage, or
    every stage for a key outside the layers."""
    stage = partition.stage_of_key(key)
    return stage is None or stage in _stage_set(stages)


def writes_key(partition: PipelinePartition, key: str, stages: Stages) -> bool:
    """Whether a rank holding ``stages`` saves ``key``: its owner, or stage 0's for keys outside layers.

    An alias of a layer's tensor (``self.head = self.layers[-1]``) is owned by that layer's stage
    (:attr:`PipelinePartition.aliases`): only it trains the tensor, so stage 0's copy would be stale,
    and loading it would overwrite the trained one.
    """
    stage, held = partition.stage_of_key(key), _stage_set(stages)
    return stage in held if stage is not None else 0 in held


held_experts = held_block
"""The experts a parameter holds when it holds some of them only: the block a checkpoint records
by global expert index (a parameter marked as holding all its experts is saved whole)."""


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The unsharded shape of a (possibly tensor-parallel, or expert-parallel) parameter."""
    shape = list(param.shape)
    dim = tensor_parallel_dim(param)
    if dim is not None:
        shape[dim] *= tp
    experts = held_experts(param)
    if experts is not None:
        shape[experts.dim] = experts.num_experts
    return tuple(shape)


def slice_for(value: Any, param: torch.Tensor | None, tp: int, tp_rank: int) -> Any:
    """This tensor rank's copy of a saved full ``value`` of (or shaped like) ``param``: its slice
    along the tensor-parallel dim, and its block of experts along the expert dim (a value that
    holds that block only, as a reader gives it, is kept).

    Always a fresh tensor: values read from a memory-mapped shard file must not stay backed by it.
    """
    if not isinstance(value, torch.Tensor):
        return value
    # A value not shaped like its parameter (Adam's 0-dim ``step``) is the same on every rank.
    if param is None or value.dim() != param.dim() or value.shape == param.shape:
        return value.detach().clone()
    experts = held_experts(param)
    if experts is not None and value.shape[experts.dim] == experts.num_experts:
        value = value.narrow(experts.dim, experts.first_expert, experts.local_experts)
    dim = tensor_parallel_dim(param)
    if dim is not None and value.shape != param.shape:
        value = value.chunk(tp, dim)[tp_rank]
    return value.detach().clone()


def _record(
    value: Any, param: torch.Tensor | None, tp: int, tp_rank: int, file: str
) -> tuple[TensorEntry, int]:
    """Where ``value`` (of, or shaped like, ``param``) goes in ``file``, and this rank's position
    among the value's files (its tensor rank, or its first expert)."""
    if not isinstance(value, torch.Tensor):
        return TensorEntry(files=(file,)), 0
    dtype = str(value.dtype).removeprefix("torch.")
    shaped = param is not None and value.shape == param.shape
    experts = held_experts(param) if shaped else None
    if experts is not None:
        assert param is not None
        shape = list(value.shape)
        shape[experts.dim] = experts.num_experts
        block = (experts.first_expert, experts.local_experts)
        entry = TensorEntry((file,), tuple(shape), dtype, expert_dim=experts.dim, experts=(block,))
        return entry, experts.first_expert
    dim = tensor_parallel_dim(param) if param is not None else None
    sharded = dim is not None and shaped
    shape = list(value.shape)
    if sharded:
        shape[dim] *= tp  # type: ignore[index]
    return (
        TensorEntry(files=(file,), shape=tuple(shape), dtype=dtype, tp_dim=dim if sharded else None),
        tp_rank if sharded else 0,
    )


def _is_sharded(value: Any, param: torch.Tensor) -> bool:
    return (
        tensor_parallel_dim(param) is not None
        and isinstance(value, torch.Tensor)
        and value.shape == param.shape
    )


def _is_expert_block(value: Any, param: torch.Tensor) -> bool:
    return held_experts(param) is not None and isinstance(value, torch.Tensor) and value.shape == param.shape


def writes_value(value: Any, param: torch.Tensor | None, tp_rank: int, ep_rank: int) -> bool:
    """Whether the rank at ``tp_rank`` and ``ep_rank`` (of the first replica) saves ``value`` (of,
    or shaped like, ``param``): every tensor rank its slice, every expert rank its block of experts;
    what is the same on several of them, the first of them."""
    if param is None:
        return tp_rank == 0 and ep_rank == 0
    return (tp_rank == 0 or _is_sharded(value, param)) and (ep_rank == 0 or _is_expert_block(value, param))


def check_expert_parameter(param: torch.Tensor, name: str) -> None:
    """Refuse a parameter split both by tensor ranks and by experts: a checkpoint records one
    split per value."""
    experts = held_experts(param)
    if experts is not None and tensor_parallel_dim(param) is not None:
        raise CheckpointError(
            f"The parameter {name!r} holds experts {experts.first_expert}-"
            f"{experts.first_expert + experts.local_experts - 1} of {experts.num_experts} and is also a "
            f"tensor-parallel slice (dim {tensor_parallel_dim(param)}); pipe_tp checkpoints record one "
            "split per value. Keep the experts whole inside a tensor-parallel group (leave them out of "
            "the tensor-parallel plan)."
        )


# ---------------------------------------------------------------------------------------- saving
def model_part(
    module: nn.Module, partition: PipelinePartition, stages: Stages, tp_rank: int, ep_rank: int = 0
) -> dict[str, Any]:
    """The model state this rank saves: its stage's keys, split ones always, replicated on tp 0
    (and, under expert parallelism, its experts always, the rest on ``ep_rank`` 0: what ``ep_rank``
    0 saves is a superset of what any expert rank of the same tensor rank saves)."""
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not writes_key(partition, key, stages):
            continue
        param = value if isinstance(value, torch.Tensor) else None
        if param is not None:
            check_expert_parameter(param, key)
        if writes_value(value, param, tp_rank, ep_rank):
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    return out


def model_entries(
    values: Mapping[str, Any], module: nn.Module, tp: int, tp_rank: int, file: str
) -> dict[str, tuple[TensorEntry, int]]:
    params = module.state_dict(keep_vars=True)
    return {key: _record(value, params.get(key), tp, tp_rank, file) for key, value in values.items()}


def parameter_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The module's name for each parameter of ``optimizer``, in ``state_dict()`` index order."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [tuple(p.shape) for p in params if id(p) not in names]
    if unknown:
        raise CheckpointError(
            f"The optimizer holds {len(unknown)} tensors that are not parameters of the LightningModule "
            f"(shapes {unknown[:_SHOWN]}); pipe_tp checkpoints name optimizer state by module parameter "
            "name. Build the optimizer from self.parameters() (or subsets of it) in configure_optimizers."
        )
    return [names[id(p)] for p in params]


def optimizer_part(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    partition: PipelinePartition,
    stages: Stages,
    tp_rank: int,
    ep_rank: int = 0,
) -> dict[str, Any]:
    """This rank's part of the optimizer state, keyed by parameter name, with the param groups."""
    saved = optimizer.state_dict()
    names = parameter_names(optimizer, module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[str, dict[str, Any]] = {}
    for index, entry in saved["state"].items():
        name, param = names[index], params[index]
        if not writes_key(partition, name, stages):
            continue
        check_cuttable(entry, param, name)
        check_expert_parameter(param, name)
        kept = {k: v for k, v in entry.items() if writes_value(v, param, tp_rank, ep_rank)}
        if kept:
            state[name] = kept
    # Groups numbered over the whole model, as one device numbers them: every rank (and one
    # device) reads the same description whatever this rank's optimizer holds.
    whole = whole_model_names(optimizer, module)
    groups = whole_groups(optimizer, module, saved["param_groups"])
    return {"state": state, "param_groups": groups, "param_names": [n for g in whole for n in g]}


def check_cuttable(entry: Mapping[str, Any], param: torch.Tensor, name: str) -> None:
    """Refuse state of a tensor-parallel (or expert-parallel) parameter that is neither shaped like
    it nor a scalar.

    Such state (Adafactor's row and column factors) differs between tensor (or expert) ranks in a
    way the checkpoint cannot describe: saving only the first rank's copy would silently give every
    rank that copy on load.
    """
    if tensor_parallel_dim(param) is not None:
        kind = "tensor-parallel"
    elif held_experts(param) is not None:
        kind = "expert-parallel"
    else:
        return
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != param.shape:
            raise CheckpointError(
                f"The optimizer state {key!r} of the {kind} parameter {name!r} has shape "
                f"{list(value.shape)}, neither the parameter's {list(param.shape)} nor a scalar, so a "
                "checkpoint cannot cut it for another layout. Use an optimizer whose state is shaped "
                f"like its parameters (SGD, Adam, AdamW...) for the {kind} layers."
            )


def check_optimizer_cuttable(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """:func:`check_cuttable` for every parameter of ``optimizer`` (named where the module names it)."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for position, param in enumerate(params):
        if param in optimizer.state:
            check_cuttable(optimizer.state[param], param, names.get(id(param), f"number {position}"))


def optimizer_entries(
    state: Mapping[str, Mapping[str, Any]], module: nn.Module, tp: int, tp_rank: int, file: str
) -> dict[str, dict[str, tuple[TensorEntry, int]]]:
    params = dict(module.named_parameters())
    return {
        name: {k: _record(v, params[name], tp, tp_rank, file) for k, v in entry.items()}
        for name, entry in state.items()
    }


# --------------------------------------------------------------------------------------- loading
_STRICT_FIX = (
    "Load it into the module that saved it, or set `self.strict_loading = False` on the "
    "LightningModule to load the keys they share."
)


def check_keys(
    saved: Iterable[str],
    expected: Iterable[str],
    where: str,
    what: str = "the model's state-dict keys",
    fix: str = _STRICT_FIX,
) -> None:
    """Raise naming the missing and unexpected keys, if any."""
    saved_set, expected_list = set(saved), list(expected)
    missing = [k for k in expected_list if k not in saved_set]
    unexpected = sorted(saved_set - set(expected_list))
    if not missing and not unexpected:
        return

    def shown(keys: list[str]) -> str:
        more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
        return f"{keys[:_SHOWN]}{more}"

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {shown(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {shown(unexpected)}")
    raise CheckpointError(f"{where} does not match {what}; " + "; ".join(parts) + ". " + fix)


def check_shapes(
    saved: Mapping[str, tuple[int, ...] | None], current: Mapping[str, Any], tp: int, where: str
) -> None:
    """Every saved full shape equals the full shape of the model's entry of that key."""
    wrong = []
    for key, value in current.items():
        shape = saved.get(key)
        if shape is not None and isinstance(value, torch.Tensor) and tuple(shape) != full_shape(value, tp):
            wrong.append(f"{key}: saved {list(shape)}, model {list(full_shape(value, tp))}")
    if wrong:
        raise CheckpointError(
            f"{where} has tensors of other shapes than the model: {wrong[:_SHOWN]}"
            + (f" and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else "")
            + ". It was saved from another model configuration: build the model it was saved from."
        )


def load_model_part(
    reader: CheckpointDirectory,
    module: nn.Module,
    partition: PipelinePartition,
    stages: Stages,
    tp: int,
    tp_rank: int,
    strict: bool,
) -> dict[str, Any]:
    """The state-dict entries a rank holding ``stages`` uses, read from ``reader`` and cut for ``tp_rank``."""
    current = module.state_dict(keep_vars=True)
    saved = reader.metadata.model
    if strict:
        check_keys(saved, current, f"The checkpoint {reader.path}")
    check_shapes({k: r.shape for k, r in saved.items()}, current, tp, f"The checkpoint {reader.path}")
    return {
        key: slice_for(
            reader.model_value(key, _experts_to_read(reader.metadata.model[key], value)),
            value if isinstance(value, torch.Tensor) else None,
            tp,
            tp_rank,
        )
        for key, value in current.items()
        if key in saved and holds_key(partition, key, stages)
    }


def _experts_to_read(record: TensorEntry, param: Any) -> range | None:
    """The experts of ``record``'s value that the rank holding ``param`` needs, when the value is
    saved in expert blocks along the dim ``param`` holds its experts along (``None``: all of it)."""
    experts = held_experts(param) if isinstance(param, torch.Tensor) else None
    if experts is None or record.expert_dim != experts.dim or record.shape is None:
        return None
    if record.shape[experts.dim] != experts.num_experts:
        return None  # another model: the shape check says so
    return experts.experts


def load_optimizer_part(
    reader: CheckpointDirectory,
    index: int,
    saved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    owned: set[int],
    tp: int,
    tp_rank: int,
) -> dict[str, Any]:
    """Optimizer ``index``'s state for the parameters in ``owned`` (ids), as an ordinary
    ``optimizer.state_dict()`` numbered for this optimizer, each value cut for ``tp_rank``."""
    names = parameter_names(optimizer, module)
    saved_names: list[str] = list(saved["param_names"])
    saved_groups = saved["param_groups"]
    where = f"Optimizer {index} in the checkpoint {reader.path}"
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where} has {len(saved_groups)} parameter groups, the model's optimizer has "
            f"{len(optimizer.param_groups)}: configure_optimizers must build the same optimizer."
        )
    whole = whole_model_names(optimizer, module)
    for g, theirs in enumerate(saved_groups):
        check_keys(
            [saved_names[i] for i in theirs["params"]],
            whole[g],
            f"{where} (parameter group {g})",
            "the parameters of that group in the model's optimizer",
            "configure_optimizers must put the same parameters in each group as the run that saved it; "
            "to keep only the weights, consolidate the checkpoint and load its state_dict.",
        )
    groups = local_groups(optimizer, saved_groups)
    records = reader.metadata.optimizers[index] if index < len(reader.metadata.optimizers) else {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, (name, param) in enumerate(zip(names, params, strict=True)):
        if id(param) in owned and name in records:
            state[i] = {
                k: reader.optimizer_value(index, name, k, _experts_to_read(r, param))
                for k, r in records[name].items()
            }
    return {"state": slice_optimizer_state(state, params, owned, tp, tp_rank), "param_groups": groups}


def slice_optimizer_state(
    state: Mapping[int, Mapping[str, Any]], params: list[torch.Tensor], owned: set[int], tp: int, tp_rank: int
) -> dict[int, dict[str, Any]]:
    """Index-keyed optimizer state restricted to ``owned`` parameters and cut for ``tp_rank``;
    a parameter-shaped value that fits neither the full nor the local shape is an error."""
    out: dict[int, dict[str, Any]] = {}
    for i, entry in state.items():
        param = params[i]
        if id(param) not in owned:
            continue
        out[i] = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() == param.dim() and v.numel() > 1:
                if tuple(v.shape) not in (tuple(param.shape), full_shape(param, tp)):
                    raise CheckpointError(
                        f"The optimizer state {k!r} of parameter {i} has shape {list(v.shape)}, which fits "
                        f"neither the parameter ({list(full_shape(param, tp))}) nor its shard "
                        f"({list(param.shape)}): the checkpoint belongs to another model."
                    )
            out[i][k] = slice_for(v, param, tp, tp_rank)
    return out
