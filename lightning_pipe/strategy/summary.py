"""What each rank holds, for the layout log and Lightning's model summary.

Under ``pipe_tp`` no rank holds the whole model: another stage's parameters are meta tensors (or,
for a model built eagerly, tensors this rank never trains) and a tensor-parallel layer is a slice.
Lightning's ``ModelSummary`` counts ``p.numel()`` of whatever the printing rank has, which mixes
whole other-stage tensors with this stage's slices. Here every stage reports, once at setup, the
whole size and the per-rank size of each of its parameters; the summary then shows whole-model
counts (as one device would) plus, per row, the stages that hold it and the most one rank holds of
it, as Lightning's ``DeepSpeedSummary`` adds "Params per Device" for ZeRO-3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn
from typing_extensions import override

from lightning_pipe.runtime import Holdings, PipelinePartition


class PipelineModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` for a model split by ``pipe_tp``: "Params" counts the whole
    model (tensor-parallel layers at full size, other stages' meta tensors included); "Params per
    Device" the most one rank holds of a row, and the stages that hold it. The example-input
    forward (sizes and FLOPs) is skipped: no rank can run the whole model."""

    def __init__(
        self,
        model: LightningModule,
        holdings: Holdings,
        partition: PipelinePartition,
        max_depth: int = 1,
        pipeline_parallel_size: int | None = None,
    ) -> None:
        self._holdings, self._partition = holdings, partition
        self._ranks = pipeline_parallel_size or partition.num_stages
        super().__init__(model, max_depth=max_depth)

    def _rows(self) -> Iterable[tuple[str, nn.Module]]:
        modules = dict(self._model.named_modules())
        return ((name, modules[name]) for name in self._layer_summary)

    def _stages_and_sizes(self, name: str, module: nn.Module) -> tuple[set[int], bool, dict[int, int], int]:
        """Stages holding ``module``, whether every rank holds some of it, the elements each
        pipeline rank holding some of it holds (one tensor rank's; a rank may hold several of its
        stages), and its whole-model elements (a shared tensor counted once)."""
        held: dict[int | None, dict[int, int]] = {}  # stage (None: every rank) -> id -> elements
        whole: dict[int, int] = {}
        for path, param in module.named_parameters(prefix=name, remove_duplicate=False):
            full, local = self._holdings.parameters.get(path, (param.numel(), param.numel()))
            whole[id(param)] = full
            held.setdefault(self._partition.stage_of_key(path), {})[id(param)] = local
        everywhere = held.pop(None, {})
        stages = {stage for stage in held if stage is not None}
        own = self._partition.stage_of_key(f"{name}.")
        if own is not None:
            stages.add(own)
        per_rank: dict[int, dict[int, int]] = {}
        for stage in stages:
            rank = self._partition.rank_of_stage(stage, self._ranks)
            per_rank.setdefault(rank, dict(everywhere)).update(held.get(stage, {}))
        return (
            stages,
            bool(everywhere),
            {r: sum(ids.values()) for r, ids in per_rank.items()},
            sum(whole.values()),
        )

    @property
    @override
    def param_nums(self) -> list[int]:
        return [self._stages_and_sizes(name, module)[3] for name, module in self._rows()]

    @property
    @override
    def total_parameters(self) -> int:
        return self._stages_and_sizes("", self._model)[3]

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(
            self._holdings.parameters.get(name, (p.numel(), 0))[0]
            for name, p in self._model.named_parameters()
            if p.requires_grad
        )

    @override
    def _forward_example_input(self) -> None:
        """Skipped: each rank holds only its stage (its sizes would be wrong, its forward fail)."""

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        column: list[str] = []
        for name, module in self._rows():
            stages, everywhere, per_rank, _ = self._stages_and_sizes(name, module)
            column.append(_per_device(stages, everywhere, per_rank, module))
        column.extend("-" for _ in range(len(arrays[0][1]) - len(column)))  # the leftover row
        # Lightning's column name for ZeRO-3 (DeepSpeedSummary): RichModelSummary shows it too.
        at = 1 + [title for title, _ in arrays].index("Params")
        arrays.insert(at, ("Params per Device", column))
        return arrays


def _per_device(stages: set[int], everywhere: bool, per_rank: dict[int, int], module: nn.Module) -> str:
    """The most one rank holds of a row, and which stages hold it."""
    if everywhere or not stages:
        held = max(per_rank.values(), default=sum(p.numel() for p in module.parameters()))
        return f"{get_human_readable_count(held)} (all)" if everywhere else get_human_readable_count(held)
    held = max(per_rank.values(), default=0)
    if len(stages) == 1:
        return f"{get_human_readable_count(held)} (stage {next(iter(stages))})"
    return f"up to {get_human_readable_count(held)} (stages {_describe_stages(stages)})"


def _describe_stages(stages: set[int]) -> str:
    low, high = min(stages), max(stages)
    if len(stages) == high - low + 1:
        return str(low) if low == high else f"{low}-{high}"
    return ", ".join(map(str, sorted(stages)))


SummaryFactory = Callable[[LightningModule, int], ModelSummary]
"""Builds the summary of a module to a depth (``ModelSummary`` callbacks' ``max_depth``)."""
