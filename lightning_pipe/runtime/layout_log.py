"""The start-of-run layout log: what a runtime made of the model, in words, once per run.

Global rank 0 shows it (``ParallelRuntime.describe``) after the first setup: the layout and
schedule, the micro-batches, the recomputation (and whether the model's own checkpointing was
taken over), each stage's layers and parameters, the nodes (each one's ranks, stages and tensor
groups), the tensor-parallel slicing, the experts per rank, the skip connections sent between
stages, the dropout that makes a run differ from one device, the data axis's sharding and a
meta-built model's storage. It only reads what the runtime built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.mesh import NodePlacement, ParallelLayout
from lightning_pipe.partition.model import PipelinePartition
from lightning_pipe.runtime.dropout_notice import describe_dropout, dropout_sources
from lightning_pipe.runtime.model_recompute import ModelCheckpointing
from lightning_pipe.runtime.options import RuntimeOptions
from lightning_pipe.runtime.prepare import Preparation
from lightning_pipe.runtime.sharding import describe_sharding
from lightning_pipe.skip.plan import SkipRoute

if TYPE_CHECKING:  # FSDP2 (and DTensor with it) is imported only where parameters are sharded
    from lightning_pipe.data_parallel.fully_sharded import FullyShardedStages


def describe_layout(
    module: nn.Module,
    layout: ParallelLayout,
    options: RuntimeOptions,
    done: Preparation,
    partition: PipelinePartition,
    layers: Sequence[nn.Module],
    skip_routes: Sequence[SkipRoute],
    fully_sharded: FullyShardedStages | None,
    recompute: RecomputeMode,
    taken: ModelCheckpointing | None,
    asked_recompute: RecomputeMode,
    num_microbatches: int | None = None,
    nodes: NodePlacement | None = None,
) -> str:
    """The layout log of a runtime over ``module`` (``done``: its preparation; ``recompute``: the
    executor's mode; ``taken``: the model's own checkpointing, taken over where it was on;
    ``num_microbatches``: the count to show, default the options'; ``nodes``: where the ranks run,
    shown per node when there are several)."""
    per_rank = None
    if layout.tensor_parallel_size > 1:
        assert done.holdings is not None
        per_rank = done.holdings.per_rank
    m = num_microbatches or options.num_microbatches or f"auto (2 x {layout.pipeline_parallel_size})"
    v = options.virtual_stages
    virtual = f" ({v} stages per rank)" if v > 1 else ""
    recompute_note = taken.describe(asked_recompute) if taken is not None else ""
    text = (
        f"pipe_tp: layout {layout} (world {layout.world_size}), schedule "
        f"{options.schedule_kind.value}{virtual}, micro-batches {m}, recompute "
        f"{recompute.value}{recompute_note}\n"
        + partition.describe(layers, per_rank, layout.pipeline_parallel_size)
    )
    if nodes is not None and nodes.num_nodes > 1:
        text += f"\n{nodes.describe(layout)}"
    if done.slicing:
        text += f"\n{done.slicing}"
    if done.experts is not None and done.experts.modules:
        text += f"\n{done.experts.describe(layout.expert_parallel_size)}"
    if skip_routes:
        routes = ", ".join(f"{r.producer} -> {r.consumer} ({', '.join(r.names)})" for r in skip_routes)
        text += f"\n  skip connections sent between stages: {routes}"
    sources = dropout_sources(module, layers)
    text += describe_dropout(sources, options.seeds_layers, layout.context_parallel_size)
    text += describe_sharding(options, layout.data_parallel_size, fully_sharded)
    if done.built_on_meta:
        text += (
            "\n  built on the meta device: each rank holds only its own stages' tensors (and tensor "
            "slices); other stages' parameters are meta tensors, without storage"
        )
    return text
