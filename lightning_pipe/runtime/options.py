"""What a :class:`~lightning_pipe.runtime.ParallelRuntime` is asked to do, in one dataclass.

The Lightning strategy fills it from its constructor arguments; a plain-torch training loop builds
it directly. Nothing here depends on the processes: it is checked when it is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from lightning_pipe.arguments import check_count, check_flag, check_positive
from lightning_pipe.execution.compile import CompileOption, compile_arguments
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.partition.balance import PartitionMethod, check_partition
from lightning_pipe.schedule.builders import ScheduleKind


def as_timeout(value: object, *, seconds: bool = False, example: str = "") -> timedelta | None:
    """``value`` as a positive ``timedelta``, or ``None``; with ``seconds``, a number counts seconds
    (the strategy's form). The one check of a timeout: ``example`` ends its error's sentence."""
    if value is None:
        return None
    timeout = value
    if seconds and isinstance(value, int | float) and not isinstance(value, bool) and value == value:
        timeout = timedelta(seconds=value) if value > 0 else timedelta(0)
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout
    allowed = "a positive number of seconds" if seconds else "None"
    raise ValueError(f"timeout must be a positive datetime.timedelta or {allowed}, got {value!r}{example}.")


class ConfigurationError(ValueError):
    """A model, plan or option the runtime cannot train as asked, with what to do instead."""


@dataclass(frozen=True)
class RuntimeOptions:
    """How to split, schedule and synchronise one model.

    Each option is documented once, by the docstring under its field (``PipeTPStrategy``'s
    ``Args:`` section is assembled from these), and checked once, here, when the options are made.
    """

    num_microbatches: int | None = None
    """Micro-batches per batch. ``None``: ``2 x pipeline_parallel_size``, capped at the batch size.
    Batches that do not divide evenly are split like ``torch.tensor_split`` and their losses
    weighted by size."""
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B
    """``"1f1b"`` (default; at most ``pipeline_parallel_size`` micro-batches of activations alive
    per stage), ``"gpipe"`` (all forwards, then all backwards), ``"interleaved_1f1b"``
    (``virtual_stages`` stages per rank in loop placement; a bubble ``virtual_stages`` times
    smaller, more activations held: Megatron's virtual pipeline) or ``"zb_h1"`` (zero-bubble:
    backward split into the input gradient, sent at once, and the weight gradient, run later in
    what would be idle time; a third of 1F1B's bubble, every stage holding up to
    ``pipeline_parallel_size`` micro-batches)."""
    partition: PartitionMethod | str | Sequence[int] = "parameters"
    """``"parameters"`` (default: balance parameter counts), ``"uniform"`` (balance layer counts),
    ``"time"`` (balance forward + backward time, measured layer by layer at setup on one sample
    micro-batch, under Lightning one of the module's ``example_input_array``; the layout log shows
    each stage's time) or a list of layer counts per stage."""
    virtual_stages: int = 1
    """Stages per pipeline rank for ``schedule="interleaved_1f1b"`` (loop placement: rank ``r``
    holds stages ``r, r + p, ...``); the model is split into ``pipeline_parallel_size x
    virtual_stages`` stages."""
    recompute: RecomputeMode | str = RecomputeMode.NEVER
    """Activation recomputation: ``"never"``, ``"except_last"`` or ``"always"``."""
    tensor_parallel_plan: Mapping[str, str] | None = None
    """Module-name pattern -> style (see :mod:`lightning_pipe.tensor_parallel.plan`); needed when
    the tensor axis has more than one rank."""
    shard_optimizer_state: bool = False
    """ZeRO-1 (Megatron's distributed optimizer): each data-parallel replica keeps the optimizer
    state of 1/data_parallel_size of its stage; gradients are reduce-scattered (still overlapping
    the last backward), each replica steps its slice and the parameters are all-gathered after
    ``optimizer.step()`` (:mod:`lightning_pipe.data_parallel.sharded_optimizer`). Element-wise
    optimizers only (SGD, Adam, AdamW, ...); after the backward, parameters' ``.grad`` are
    ``None`` (the averaged gradient exists only as slices). Checkpoints stay unsharded by
    parameter name."""
    overlap_param_gather: bool = True
    """With ``shard_optimizer_state``, the parameters' all-gather is launched after the step and
    each layer's next forward waits for its own buckets (Megatron's ``overlap_param_gather``);
    weights read in between (a callback, a checkpoint, validation, after ``fit``) wait for all of
    it first (:mod:`lightning_pipe.data_parallel.parameter_gather`). Not guarded: reads from
    another Python thread (torch's function-mode stack is per thread) and through an alias made
    before the step (``self.ref = p.detach()``): call ``runtime.wait_for_parameters()`` first
    (safe from any thread). ``False``: the step waits for the gather."""
    sequence_parallel: bool = False
    """With ``tensor_parallel_size > 1``, keep the activations between the tensor-parallel regions
    (norms, dropout, the residual stream, what stages exchange) split along the sequence over the
    tensor ranks (Megatron's sequence parallelism); the plan says where the split begins
    (``sequence_scatter``) and which modules see the whole sequence (``sequence_gather``). Turns
    on ``layer_seeded_dropout``."""
    layer_seeded_dropout: bool | None = None
    """Each layer draws its dropout masks from a seed of (the run's seed, the training batch, the
    micro-batch, the layer's index): the same masks whatever the pipeline and tensor split, equal to
    this model under pipe_tp on one process with the same ``num_microbatches``
    (:mod:`lightning_pipe.execution.seeding`). Two exceptions: data-parallel replicas draw equal
    masks for their different samples (one process would draw one mask for the whole batch), and
    ``"dropout"`` plan entries keep their per-tensor-rank streams. ``None``: on with
    ``sequence_parallel``, else off (each rank draws from its own generator: reproducible, but a
    pipeline's masks are not one device's). ``True`` is refused with ``context_parallel_size > 1``
    (each rank draws the masks of its part of the sequences)."""
    shard_parameters: bool = False
    """FSDP2 over the data axis: each data-parallel rank keeps 1/dp of its stage's parameters,
    gradients and optimizer state (:mod:`lightning_pipe.data_parallel.fully_sharded`)."""
    data_parallel_replicate_size: int = 1
    """HSDP under ``shard_parameters``: the data axis as this many replicas of
    ``data_parallel_size / this`` shards each."""
    reshard_after_forward: bool | None = None
    """Under ``shard_parameters``: ``False`` gathers a stage's parameters once per step and reduces
    its gradients once per accumulation window; ``True`` frees them after each unit's forward and
    reduces every backward (least memory, ``num_microbatches`` times the communication; refused
    for zero-bubble schedules). ``None``: ``True`` without a pipeline (one stage, no split
    backward), else ``False``."""
    param_dtype: torch.dtype | None = None
    """Under ``shard_parameters``: the dtype parameters are gathered and computed in (FSDP2's
    ``MixedPrecisionPolicy``; gradients reduced in float32). ``None``: their own."""
    expert_parallel_size: int = 1
    """Ranks of the data axis that split each mixture-of-experts layer's experts between them
    (expert parallelism: it divides ``data_parallel_size`` and the expert count of every such
    layer). Each rank of an expert group holds ``1/expert_parallel_size`` of the experts (a block
    by global expert index) and the tokens go to the ranks holding their chosen experts and come
    back by all-to-all (dropless); routers, shared experts and everything else stay whole on every
    data rank. Expert gradients are reduced over the ranks holding the same experts, the rest over
    the whole data axis; the experts stay whole inside a tensor group
    (:mod:`lightning_pipe.experts`). A Hugging Face mixture-of-experts model takes its plan from
    its ``config.base_model_ep_plan``. With ``shard_optimizer_state`` (ZeRO-1) or
    ``shard_parameters`` (FSDP2) the experts' state is sharded over the ranks holding the same
    experts, the rest over the whole data axis. Refused with ``sequence_parallel``."""
    expert_parallel_plan: Mapping[str, str] | None = None
    """Module-name pattern -> expert-parallel style (Hugging Face's ``base_model_ep_plan`` format:
    ``"ep_dispatch_experts"`` on each experts module, ``"grouped_gemm"`` on its weights stacked by
    expert; :mod:`lightning_pipe.experts.apply`); needed when ``expert_parallel_size > 1`` (derived
    for a Hugging Face model)."""
    context_parallel_size: int = 1
    """Ranks of the data axis that split every sequence between them (context parallelism: it
    divides ``data_parallel_size``; the ranks of a context group get the same samples). Each rank
    keeps ``1/context_parallel_size`` of each micro-batch's tokens (``2C`` chunks paired head to
    tail, so every rank does the same causal work) and computes every layer on them; attention is
    exact over the whole sequence by ring attention (a Hugging Face model's attention is replaced
    through transformers' attention interface; a hand-written model calls
    :func:`lightning_pipe.context.ring_attention`). Gradients are reduced once over the whole data
    axis. The sequence length must be a multiple of ``2C``, and the loss weighted by token counts
    (a Hugging Face batch's ``labels``, or the model's ``loss_items``); a Hugging Face batch's
    ``labels`` reach the step as ``shift_labels`` (targets aligned with the tokens, cut alike).
    Not yet with ``expert_parallel_size > 1`` or ``partition="time"``
    (:mod:`lightning_pipe.context`)."""
    bucket_cap_mb: float = 25.0
    """Size of the gradient buckets of the data-parallel reducer, whose all-reduces overlap the
    last backward of each optimizer step."""
    timeout: timedelta | None = None
    """Deadline of every pipeline exchange: past it the waiting rank raises an error naming itself,
    its stage, the action and micro-batch it waited on and its peer, and the job stops instead of
    hanging. ``None``: the process group's."""
    check_finite: bool = False
    """Raise as soon as a stage output or a loss holds NaN/Inf, naming the stage and micro-batch
    where it first appeared."""
    deferred_batch_norm: bool = True
    """BatchNorm layers update their running statistics once per batch, from the statistics of the
    whole batch (summed over micro-batches and data-parallel replicas), so evaluation uses the
    statistics one device would have (torchgpipe's deferred batch norm). ``False``: they update
    once per micro-batch."""
    allow_batch_norm_microbatches: bool = False
    """Train a model holding BatchNorm layers with several micro-batches per batch, each normalised
    in training by its own statistics (not the batch's, as on one device: a different model, said
    once as a warning). ``False`` (default): such a model is refused at setup, naming the fixes
    (``num_microbatches=1``, GroupNorm/LayerNorm, or this option)."""
    check_forward: bool = True
    """On the first step after setup, check that the module's ``forward`` is its pipeline layers
    chained (logic around them would be skipped in training). ``False`` skips the check (and its
    warning when a meta-built model cannot be compared)."""
    compile: CompileOption = False
    """``torch.compile`` each pipeline layer of this rank's stages (as torchtitan compiles each
    transformer block), after tensor-parallel slicing and FSDP2 wrapping: ``True`` with
    ``torch.compile``'s defaults (inductor), or a dict of its keyword arguments, e.g.
    ``{"backend": "aot_eager", "fullgraph": True}``. The layer's ``forward`` is compiled in place
    (names and checkpoints unchanged; the layer's own hooks, FSDP2's among them, run outside the
    graph). A layer already compiled by the user (``torch.compile(layer)`` or ``layer.compile()``)
    runs as it is. Under ``"zb_h1"`` a compiled layer computes its weight gradients with its input
    gradient (its backward is one graph), so compiled layers leave no weight work for the bubble;
    tensor parallelism's collectives break a layer's graph (``fullgraph=True`` is refused with
    it) (:mod:`lightning_pipe.execution.compile`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", ScheduleKind.parse(self.schedule))
        object.__setattr__(self, "recompute", RecomputeMode.parse(self.recompute))
        if self.num_microbatches is not None:
            check_count("num_microbatches", self.num_microbatches, also="None (2 x pipeline_parallel_size)")
        check_partition(self.partition)
        v = self.virtual_stages
        check_count("virtual_stages", v)
        if v > 1 and self.schedule_kind is not ScheduleKind.INTERLEAVED_1F1B:
            raise ValueError(
                f"virtual_stages={v} (several stages per pipeline rank) needs "
                f"schedule='interleaved_1f1b', the only schedule with several; got "
                f"schedule={self.schedule_kind.value!r}."
            )
        self._check_sharding()
        self._check_experts()
        self._check_context()
        check_positive("bucket_cap_mb", self.bucket_cap_mb, "megabytes per gradient bucket")
        for name in (
            "shard_optimizer_state",
            "overlap_param_gather",
            "check_finite",
            "deferred_batch_norm",
            "allow_batch_norm_microbatches",
            "check_forward",
            "sequence_parallel",
        ):
            check_flag(name, getattr(self, name))
        if self.layer_seeded_dropout is not None:
            check_flag("layer_seeded_dropout", self.layer_seeded_dropout)
        as_timeout(self.timeout)
        compile_arguments(self.compile)

    @property
    def compile_arguments(self) -> dict[str, Any] | None:
        """``compile`` as ``torch.compile``'s keyword arguments; ``None``: off."""
        return compile_arguments(self.compile)

    @property
    def seeds_layers(self) -> bool:
        """Whether layers draw from their own seeds (``layer_seeded_dropout``, resolved)."""
        if self.layer_seeded_dropout is None:
            return self.sequence_parallel
        return self.layer_seeded_dropout

    def _check_experts(self) -> None:
        check_count("expert_parallel_size", self.expert_parallel_size)
        if self.expert_parallel_size == 1:
            return
        if self.sequence_parallel:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} cannot be combined with "
                "sequence_parallel=True: the experts stay whole inside a tensor group, and under sequence "
                "parallelism each tensor rank would route and dispatch only its part of the sequence, so "
                "the routers' and experts' gradients would be partial per tensor rank (a sum over the "
                "tensor group pipe_tp does not make). Use sequence_parallel=False (tensor parallelism "
                "itself composes), or expert_parallel_size=1."
            )

    def _check_context(self) -> None:
        check_count("context_parallel_size", self.context_parallel_size)
        if self.context_parallel_size == 1:
            return
        if self.expert_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} cannot be combined with "
                f"expert_parallel_size={self.expert_parallel_size} yet (both borrow ranks from the data "
                "axis); use one of them."
            )
        if self.layer_seeded_dropout is True:
            # Each rank draws its chunks' masks with its chunks' shapes: not one device's, nor
            # another layout's, which is what the option promises.
            raise ValueError(
                f"layer_seeded_dropout=True cannot promise the same dropout masks on every layout with "
                f"context_parallel_size={self.context_parallel_size} (each rank draws masks for its part of "
                "the sequences, not the whole sequence's): leave layer_seeded_dropout unset, or use "
                "context_parallel_size=1."
            )
        if str(getattr(self.partition, "value", self.partition)) == "time":
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} cannot be combined with "
                "partition='time' yet (the layers are timed on one process, outside any context group, "
                "where ring attention has no other ranks' keys); use partition='parameters' or "
                "'uniform', or a list of layer counts."
            )

    def _check_sharding(self) -> None:
        check_flag("shard_parameters", self.shard_parameters)
        check_count("data_parallel_replicate_size", self.data_parallel_replicate_size)
        if self.reshard_after_forward is not None:
            check_flag("reshard_after_forward", self.reshard_after_forward)
        if self.param_dtype is not None and not (
            isinstance(self.param_dtype, torch.dtype) and self.param_dtype.is_floating_point
        ):
            raise ValueError(f"param_dtype must be a floating torch.dtype or None, got {self.param_dtype!r}.")
        if self.shard_parameters:
            if self.shard_optimizer_state:
                raise ValueError(
                    "shard_parameters=True already shards the optimizer state (with the parameters and "
                    "gradients); drop shard_optimizer_state=True (ZeRO-1), or use it without "
                    "shard_parameters."
                )
            if self.reshard_after_forward and ScheduleKind.parse(self.schedule).splits_backward:
                raise ValueError(
                    f"reshard_after_forward=True reduces each backward's gradients, but schedule="
                    f"{ScheduleKind.parse(self.schedule).value!r} computes the weight gradients in a "
                    "later pass, after that reduction. Use reshard_after_forward=False (or None), or a "
                    "schedule that does not split backward."
                )
            return
        unused = [
            f"{name}={getattr(self, name)!r}"
            for name, default in (
                ("data_parallel_replicate_size", 1),
                ("reshard_after_forward", None),
                ("param_dtype", None),
            )
            if getattr(self, name) != default
        ]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} applies to a fully sharded data axis only: set "
                "shard_parameters=True too, or leave it out."
            )

    def resolved_reshard_after_forward(self, pipeline_parallel_size: int) -> bool:
        """``reshard_after_forward`` with ``None`` decided (see its docstring)."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return (
            pipeline_parallel_size == 1
            and self.virtual_stages == 1
            and not self.schedule_kind.splits_backward
        )

    @property
    def schedule_kind(self) -> ScheduleKind:
        """``schedule`` as the enum (``__post_init__`` stored it so; typed for readers)."""
        return ScheduleKind.parse(self.schedule)

    @property
    def recompute_mode(self) -> RecomputeMode:
        """``recompute`` as the enum."""
        return RecomputeMode.parse(self.recompute)
