"""Which layers, parameters and state-dict keys of a model each pipeline stage owns.

Every rank sees the whole model's structure (built eagerly, or with its parameters on the meta
device) and keeps the layers of its stage. The partition records that split once, with the checks that make a
mistake visible at setup rather than as a wrong gradient later: layers must be distinct submodules
of the model and every trainable parameter must belong to some layer. A parameter shared by layers
on different stages (a token embedding tied to the output head) is recorded as *tied*: each stage
that uses it keeps a copy, and the strategy sums their gradients across exactly those stages after
backward, so the copies stay identical, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from lightning_pipe.partition.balance import Partition, compute_balance, parameter_count


@dataclass(frozen=True)
class PipelinePartition:
    """The split of a model's pipeline layers into stages."""

    layer_names: tuple[str, ...]
    """Qualified name of each pipeline layer inside the model, in pipeline order."""
    balance: tuple[int, ...]
    """Number of layers of each stage."""
    parameter_counts: tuple[int, ...]
    """Distinct parameter elements of each layer."""
    tied: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Parameters used by layers on several stages (tied weights): model parameter name and the
    stages that hold a copy, whose gradients must be summed across exactly those stages."""
    aliases: tuple[tuple[str, int], ...] = ()
    """State-dict keys outside every pipeline layer that name a layer's tensor
    (``self.head = self.layers[-1]``), with the stage of that layer: only that stage trains the
    tensor, so only its copy is current (found before tensor-parallel sharding, so that every
    rank agrees)."""
    layer_times: tuple[float, ...] = ()
    """Each layer's measured forward + backward seconds per micro-batch (``partition="time"``;
    empty otherwise)."""
    tied_counts: tuple[int, ...] = ()
    """Per stage, the parameter elements it shares with other stages (tied weights, counted in
    each of their stages' ``parameter_counts``); empty without ties."""

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    def layer_range(self, stage_index: int) -> range:
        start = sum(self.balance[:stage_index])
        return range(start, start + self.balance[stage_index])

    def stages_of_rank(self, pp_rank: int, pipeline_parallel_size: int) -> tuple[int, ...]:
        """The stage indices pipeline rank ``pp_rank`` holds: the one mapping every part of the
        runtime reads (one stage per rank when there are as many stages as ranks; in loop
        placement, stages r, r + p, ..., when each rank holds several)."""
        return tuple(range(pp_rank, self.num_stages, pipeline_parallel_size))

    def rank_of_stage(self, stage_index: int, pipeline_parallel_size: int) -> int:
        """The pipeline rank that holds ``stage_index`` (the inverse of :meth:`stages_of_rank`)."""
        return stage_index % pipeline_parallel_size

    def stage_of_layer(self, layer_index: int) -> int:
        for stage in range(self.num_stages):
            if layer_index in self.layer_range(stage):
                return stage
        raise IndexError(f"layer {layer_index} is outside the {len(self.layer_names)} pipeline layers")

    def stage_of_key(self, key: str) -> int | None:
        """The stage that owns a state-dict key of the model, ``None`` for keys outside all layers
        (other than aliases of a layer's tensor, which belong to the layer's stage)."""
        for index, name in enumerate(self.layer_names):
            if key.startswith(name + "."):
                return self.stage_of_layer(index)
        return self._alias_stages.get(key)

    @cached_property
    def _alias_stages(self) -> dict[str, int]:
        return dict(self.aliases)

    def describe(
        self,
        layers: Sequence[nn.Module],
        per_rank: Callable[[int], int] | None = None,
        pipeline_parallel_size: int | None = None,
    ) -> str:
        """A table of stages, their layers and parameter counts, for the start-of-run log;
        ``per_rank(stage_index)``: the elements one rank of that stage holds (under tensor
        parallelism, less than the stage's); with more stages than ``pipeline_parallel_size``
        ranks, each line names the rank that holds the stage."""
        lines = []
        for stage in range(self.num_stages):
            rng = self.layer_range(stage)
            kinds = ", ".join(type(layers[i]).__name__ for i in rng)
            params = sum(self.parameter_counts[i] for i in rng)
            held = "" if per_rank is None else f" ({per_rank(stage):,} per rank)"
            tied = self.tied_counts[stage] if self.tied_counts else 0
            if tied:
                # A tied weight has a copy on each stage that uses it: say so, or the stages'
                # counts seem to add up to more than the model.
                others = sorted({t for _, st in self.tied if stage in st for t in st} - {stage})
                names = ", ".join(str(t) for t in others)
                held += f", {tied:,} of them tied with stage{'s' if len(others) > 1 else ''} {names}"
            if self.layer_times:
                measured = sum(self.layer_times[i] for i in rng) * 1e3
                held += f", {measured:.3g} ms forward + backward per micro-batch (measured)"
            p = pipeline_parallel_size
            where = f" on pp_rank {self.rank_of_stage(stage, p)}" if p and p != self.num_stages else ""
            lines.append(
                f"  stage {stage}{where}: layers {rng.start}-{rng.stop - 1} ({kinds}), {params:,} "
                f"parameters{held}"
            )
        return "\n".join(lines)


def partition_model(
    model: nn.Module,
    layers: Sequence[nn.Module],
    num_stages: int,
    method: Partition = "parameters",
    layer_times: Sequence[float] | None = None,
) -> PipelinePartition:
    """Check ``layers`` against ``model`` and split them into ``num_stages`` stages
    (``layer_times``: measured seconds per layer, for ``partition="time"``)."""
    if not isinstance(layers, Sequence) or isinstance(layers, nn.Module) or not layers:
        raise TypeError(
            "configure_pipeline() must return a non-empty list of nn.Module layers in pipeline order, "
            f"got {type(layers).__name__}. For an nn.Sequential `self.layers`, return list(self.layers)."
        )
    names_by_id = {id(m): name for name, m in model.named_modules() if name}
    names: list[str] = []
    for position, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"configure_pipeline() item {position} is a {type(layer).__name__}, not an nn.Module."
            )
        if id(layer) not in names_by_id:
            raise ValueError(
                f"configure_pipeline() item {position} ({type(layer).__name__}) is not a submodule of "
                f"{type(model).__name__}: assign it to an attribute (e.g. inside an nn.ModuleList) so its "
                "parameters are registered, saved and optimised."
            )
        names.append(names_by_id[id(layer)])
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"configure_pipeline() lists the layers {repeated} more than once.")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"configure_pipeline() lists both {a!r} and its submodule {b!r}; list each layer once."
                )

    balance = compute_balance(layers, num_stages, method, layer_times)
    times = tuple(layer_times) if layer_times is not None else ()
    split = PipelinePartition(
        tuple(names), tuple(balance), tuple(parameter_count(m) for m in layers), layer_times=times
    )

    stages_of_param: dict[int, set[int]] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            stages_of_param.setdefault(id(param), set()).add(split.stage_of_layer(index))
    tied = tuple(
        (name, tuple(sorted(stages_of_param[id(p)])))
        for name, p in model.named_parameters()
        if p.requires_grad and len(stages_of_param.get(id(p), ())) > 1
    )
    # The first stage that uses a tensor owns its aliases (a tied tensor's copies stay equal).
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    stage_of_tensor: dict[int, int] = {}
    for key, value in state.items():
        stage = split.stage_of_key(key)
        if stage is not None:
            stage_of_tensor.setdefault(id(value), stage)
    aliases = tuple(
        (key, stage_of_tensor[id(value)])
        for key, value in state.items()
        if split.stage_of_key(key) is None and id(value) in stage_of_tensor
    )
    if tied or aliases:
        sizes = {name: p.numel() for name, p in model.named_parameters()}
        tied_counts = tuple(
            sum(sizes[name] for name, stages in tied if stage in stages) for stage in range(num_stages)
        )
        split = PipelinePartition(
            split.layer_names,
            split.balance,
            split.parameter_counts,
            tied,
            aliases,
            times,
            tied_counts if tied else (),
        )
    stray = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in stages_of_param]
    if stray:
        raise ValueError(
            f"The trainable parameters {stray} belong to no layer returned by configure_pipeline(), so no "
            "pipeline stage would train them. Move them into a pipeline layer, or freeze them with "
            "requires_grad_(False)."
        )
    return split
