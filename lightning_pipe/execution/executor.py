"""The one interpreter that runs any schedule on one pipeline rank.

It walks the rank's action list: a forward runs the stage's layers on a micro-batch and stashes
what backward needs, a backward pops the stash and drives autograd (from the loss on the last
stage, from the received output gradient elsewhere), and each run of consecutive communication
actions is posted as one batch through :class:`~lightning_pipe.execution.p2p.P2PTransport`.

Gradients accumulate in ``.grad`` across micro-batches; the last stage scales each micro-batch's
loss by its weight (by default ``1 / num_microbatches``, or its share of the samples), so the
accumulated gradient equals the whole batch's on one device.

Skip connections (:mod:`lightning_pipe.skip`) ride along: each stage's forward runs in a
:class:`~lightning_pipe.skip.scope.SkipScope` that holds what it may pop (received like an input,
a leaf whose gradient goes back) and collects what it stashes (sent like an output, an extra root
of the stage's backward, whose gradient comes back from each consumer).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_pipe.execution.batchnorm import running_backward
from lightning_pipe.execution.layers import Activation
from lightning_pipe.execution.p2p import ActivationMeta, P2PTransport, RecvRequest, SendRequest
from lightning_pipe.execution.recompute import RecomputeMode, Replay, run_in, run_recomputed
from lightning_pipe.execution.split_backward import WeightGradients, backward_input
from lightning_pipe.faults.board import FaultBoard
from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule, comm_batches
from lightning_pipe.skip.layers import SkipDeclaration
from lightning_pipe.skip.plan import SkipRoute
from lightning_pipe.skip.scope import SkipError, SkipScope


@dataclass
class StepResult:
    """What one step returns on this rank; ``outputs`` is filled on the last stage only."""

    outputs: dict[int, Any] = field(default_factory=dict)
    """Micro-batch index -> what ``head`` returned for it (the loss when training)."""
    peak_stashed: int = 0
    """The most micro-batches whose activations this rank kept alive at once."""
    peak_activation_bytes: int = 0
    """Most bytes of tensors autograd saved for backward, over the micro-batches alive at once
    (measured only with ``PipelineExecutor.measure_activation_memory``)."""
    peak_held_bytes: int = 0
    """Most bytes of tensors held for backward over the micro-batches alive at once: what autograd
    saved, and also the stage inputs, outputs and popped skip tensors the step keeps until the
    backward, which a layer that only passes a tensor on never saves (also measured only with
    ``measure_activation_memory``)."""


ActionRecorder = Callable[[Action, float, float], None]
"""Called with an action and its start and end (``time.perf_counter()`` seconds) after it ran; a
communication batch reports each of its actions with the batch's span (post and wait)."""


def _as_tuple(value: Activation) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _stand_in(value: Activation) -> Activation:
    """Leaves with ``value``'s data, grad-requirement and Python attributes (a tensor-parallel
    head's vocabulary tag, which the loss reads), without its graph."""
    if isinstance(value, tuple):
        return tuple(_leaf(t) for t in value)
    return _leaf(value)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    leaf = tensor.detach().requires_grad_(tensor.requires_grad)
    for name, attribute in vars(tensor).items():
        setattr(leaf, name, attribute)
    return leaf


def _counting_pack(saved: dict[tuple[int, int], int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A saved-tensor hook that records each distinct saved tensor's bytes and keeps the tensor."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[(tensor.data_ptr(), tensor.nbytes)] = tensor.nbytes
        return tensor

    return pack


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_BACKWARDS = (ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)

_WHAT = {
    ActionType.FORWARD: "the forward of",
    ActionType.BACKWARD: "the backward of",
    ActionType.BACKWARD_INPUT: "the input-gradient backward of",
    ActionType.BACKWARD_WEIGHT: "the weight-gradient backward of",
    ActionType.SEND_F: "sending the activation of",
    ActionType.RECV_F: "receiving the activation of",
    ActionType.SEND_B: "sending the input gradient of",
    ActionType.RECV_B: "receiving the output gradient of",
    ActionType.SEND_SKIP: "sending the skip connections stashed by",
    ActionType.RECV_SKIP: "receiving the skip connections popped by",
    ActionType.SEND_SKIP_GRAD: "sending the skip connections' gradients of",
    ActionType.RECV_SKIP_GRAD: "receiving the skip connections' gradients of",
}


def _describe(action: Action) -> str:
    """``action`` in words, for error messages: what, which stage, which micro-batch."""
    other = "" if action.peer_stage is None else f" (other end: stage {action.peer_stage})"
    return (
        f"{_WHAT[action.kind]} stage {action.stage_index}, micro-batch {action.microbatch}{other} ({action})"
    )


def _carries(tensor: torch.Tensor) -> bool:
    """Whether a gradient travels back for a skip's tensor (as ``TensorMeta.carries_grad``)."""
    return tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())


_RECEIVES = (ActionType.RECV_F, ActionType.RECV_B, ActionType.RECV_SKIP, ActionType.RECV_SKIP_GRAD)


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(note)


def _check_finite(value: Activation, where: str) -> None:
    for k, t in enumerate(_as_tuple(value)):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            part = f" (tensor {k})" if isinstance(value, tuple) else ""
            raise FloatingPointError(f"NaN or Inf first appeared in {where}{part}.")


def receives_early(setting: bool | None, device: torch.device, schedule: PipelineSchedule) -> bool:
    """Whether each exchange also posts the next one's receives (``PipelineExecutor.receive_early``):
    ``None`` picks on for gloo with interleaved or zero-bubble schedules; ``True`` on CUDA is
    refused (see the attribute's docstring)."""
    if setting is None:
        several = len(schedule.stage_to_rank) > schedule.num_ranks
        return device.type != "cuda" and (several or schedule.splits_backward)
    if setting and device.type == "cuda":
        raise ValueError(
            "PipelineExecutor.receive_early=True cannot run on CUDA: NCCL completes the operations of an "
            "exchange together, so a receive posted one exchange early waits for a message the peer sends "
            "later and the pipeline deadlocks. Leave it None (the default) or set it to False."
        )
    return setting


class PipelineExecutor:
    """Runs schedules for the stages this rank holds.

    Args:
        stages: stage index -> that stage's ordered layers (several under interleaved schedules).
        num_stages: total number of stages of the pipeline.
        peers: global rank of every pipeline rank of this pipeline, indexed by ``pp_rank``.
        device: where received tensors are allocated.
        recompute: activation recomputation mode.
        group: process group for point-to-point calls (``None``: the default group; peers are
            global ranks either way).
        timeout: deadline of every exchange with a neighbour (``None``: the process group's).
        check_finite: raise as soon as a stage output or a loss holds NaN or Inf, naming the
            stage and micro-batch where it first appeared (costs a reduction per output).
        board: names the peer that stopped (vanished, raised) when an exchange loses it.
        skips: the skip connections' routes between stages (every route of the pipeline, also
            those between other ranks' stages; they must be the schedule's ``skips``).
        skip_declarations: stage index -> what its layers declare they stash and pop (a stash or
            pop of another name is refused); stages left out declare nothing.
    """

    def __init__(
        self,
        stages: dict[int, Sequence[nn.Module]],
        num_stages: int,
        peers: Sequence[int],
        device: torch.device,
        recompute: RecomputeMode | str = RecomputeMode.NEVER,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        check_finite: bool = False,
        board: FaultBoard | None = None,
        skips: Sequence[SkipRoute] = (),
        skip_declarations: dict[int, SkipDeclaration] | None = None,
    ) -> None:
        self.stages = {s: list(layers) for s, layers in stages.items()}
        self.skips = tuple(skips)
        self._skip_pairs = tuple(sorted((r.producer, r.consumer) for r in self.skips))
        self._skips_from = {s: [r for r in self.skips if r.producer == s] for s in self.stages}
        self._skips_into = {s: [r for r in self.skips if r.consumer == s] for s in self.stages}
        declared = {s: (skip_declarations or {}).get(s, SkipDeclaration()) for s in self.stages}
        # Frozen once: each forward's scope takes them as they are (no copy per micro-batch).
        self._declared = {s: (frozenset(d.stash), frozenset(d.pop)) for s, d in declared.items()}
        self.num_stages = num_stages
        self.peers = list(peers)
        self.recompute = RecomputeMode.parse(recompute)
        self.check_finite = check_finite
        self.transport = P2PTransport(device, group, timeout, board=board)
        self.measure_activation_memory = False
        """Count the bytes autograd saves per micro-batch (a hook per saved tensor when on)."""
        self.receive_early: bool | None = None
        """Post each exchange's receives one exchange early and wait for a receive only when its
        data is first used, so that the transfer overlaps the computation in between. ``None``
        (default): on with gloo for interleaved and zero-bubble schedules, off
        otherwise. Measured on this project's 2-core machine (benchmarks/README.md): it shortens
        interleaved steps (0.70 - 0.92) and zero-bubble ones (0.98), but makes overhead-bound 1F1B
        steps up to 3x slower (gloo's posting calls slow down while a receive is outstanding) and
        leaves fixed-time 1F1B and GPipe within noise. Refused on CUDA (NCCL): the operations of a
        batch complete together, so a receive moved into an earlier batch makes the rank wait for
        a message its peer sends only later, a deadlock for 1F1B, ZB-H1 and interleaved schedules
        (docs/gpu.md, F2)."""
        self.receives_posted_early = 0
        """How many receives were posted one exchange early so far (a counter for tests and
        benchmarks)."""

    # ------------------------------------------------------------------ step state
    def _reset(self) -> None:
        self._received: dict[tuple[int, int], RecvRequest] = {}
        self._early: dict[Action, RecvRequest] = {}
        self._outputs: dict[tuple[int, int], Activation] = {}
        self._output_meta: dict[tuple[int, int], ActivationMeta] = {}
        self._input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._stash: dict[tuple[int, int], tuple[list[torch.Tensor], Activation]] = {}
        self._stash_bytes: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        self._held_bytes: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        self._replay: dict[tuple[int, int], Replay] = {}
        self._weight_work: dict[tuple[int, int], list[WeightGradients]] = {}
        # Skip connections, keyed (producer, consumer, micro-batch): tensors handed to a consumer
        # on this rank, tensors to send, what was sent (for the gradient's receive), gradients
        # handed back on this rank or received; per (stage, micro-batch): the consumer's leaves and
        # the producer's stashed tensors and routes, which its backward starts from.
        self._skip_local: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._skip_out: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._skip_meta: dict[tuple[int, int, int], ActivationMeta] = {}
        self._skip_grads: dict[tuple[int, int, int], list[torch.Tensor] | RecvRequest] = {}
        self._skip_grads_out: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._skip_leaves: dict[tuple[int, int], list[tuple[int, list[torch.Tensor]]]] = {}
        self._skip_roots: dict[tuple[int, int], list[tuple[int, list[GradientEdge]]]] = {}
        self._received_skips: dict[tuple[int, int, int], RecvRequest] = {}
        self._result = StepResult()

    def run(
        self,
        schedule: PipelineSchedule,
        pp_rank: int,
        inputs: Sequence[Any] | None = None,
        head: Callable[[Activation, int], Any] | None = None,
        weights: Sequence[float] | None = None,
        signatures: Sequence[Hashable] | None = None,
        *,
        recorder: ActionRecorder | None = None,
        before_last_backward: Callable[[], None] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        layer_seeds: Callable[[int, int], Sequence[int]] | None = None,
    ) -> StepResult:
        """Run ``schedule``'s actions for ``pp_rank``.

        Args:
            inputs: the micro-batches' pipeline inputs (needed on the rank of stage 0).
            head: called on the last stage with each micro-batch's pipeline output and its index;
                when training it must return the micro-batch's scalar loss.
            weights: per micro-batch loss weights (default ``1 / num_microbatches`` each).
            signatures: per micro-batch hashable shape signatures, equal on every rank of the
                pipeline; they let repeated shapes skip header messages (see :mod:`.p2p`).
            recorder: the timeline's hook, called with each action and its span (``None``: one
                test per action).
            before_last_backward: called once, right before this rank's last backward action
                (where a data-parallel reducer arms itself to overlap its all-reduce with it).
            scale_loss: applied to each weighted micro-batch loss before its backward (a gradient
                scaler's ``scale`` under fp16).
            layer_seeds: ``layer_seeds(stage_index, microbatch)``: a seed per layer of the stage,
                from which each layer draws when training (layer-seeded dropout, see
                :mod:`.seeding`); ``None``: the program's own random streams.
        """
        m = schedule.num_microbatches
        held = schedule.stages_of(pp_rank)
        if sorted(held) != sorted(self.stages):
            raise ValueError(
                f"Pipeline rank {pp_rank} holds stages {sorted(self.stages)} but the schedule "
                f"places stages {held} on it."
            )
        if 0 in self.stages and (inputs is None or len(inputs) != m):
            given = "none" if inputs is None else len(inputs)
            raise ValueError(f"The first stage needs {m} micro-batch inputs, got {given}.")
        if self.num_stages - 1 in self.stages and head is None:
            raise ValueError("The last stage needs a head (loss or output function) to call.")
        if schedule.skips != self._skip_pairs:
            raise ValueError(
                f"The schedule has skip connections between stages {list(schedule.skips)}, the executor "
                f"{list(self._skip_pairs)}: build the schedule with the executor's routes "
                "(build_schedule(..., skips=[(r.producer, r.consumer) for r in routes]))."
            )
        for name, seq in (("weights", weights), ("signatures", signatures)):
            if seq is not None and len(seq) != m:
                raise ValueError(f"{name} has {len(seq)} entries for {m} micro-batches.")
        self._schedule, self._inputs, self._head = schedule, inputs, head
        self._scale_loss = scale_loss
        self._layer_seeds = layer_seeds
        self._weights = list(weights) if weights is not None else [1.0 / m] * m
        self._signatures = signatures
        self._pp_rank = pp_rank
        self.transport.owner = f"Pipeline rank {pp_rank} (global rank {self.peers[pp_rank]}, stages {held})"
        self._reset()
        try:
            batches = comm_batches(schedule.actions[pp_rank])
            last_backward = max((k for k, b in enumerate(batches) if b[0].kind in _BACKWARDS), default=-1)
            early = receives_early(self.receive_early, self.transport.device, schedule)
            # For each exchange, the next one (whose receives it may post early).
            following: dict[int, list[Action]] = {}
            upcoming: list[Action] = []
            for k in reversed(range(len(batches))):
                if batches[k][0].kind.is_comm:
                    following[k] = upcoming
                    upcoming = batches[k]
            for position, batch in enumerate(batches):
                if position == last_backward and before_last_backward is not None:
                    before_last_backward()
                start = time.perf_counter() if recorder is not None else 0.0
                if batch[0].kind.is_compute:
                    try:
                        self._compute(batch[0])
                    except Exception as err:
                        _add_note(err, f"{self.transport.owner} was running {_describe(batch[0])}.")
                        raise
                else:
                    self._communicate(batch, following[position] if early else [], early)
                if recorder is not None:
                    end = time.perf_counter()
                    for action in batch:
                        recorder(action, start, end)
            self.transport.flush()
            return self._result
        finally:
            self._reset()
            self._inputs = None

    # ------------------------------------------------------------------ compute
    def _compute(self, action: Action) -> None:
        s, i = action.stage_index, action.microbatch
        if action.kind is ActionType.FORWARD:
            self._forward(s, i)
        elif action.kind is ActionType.BACKWARD:
            self._backward(s, i)
        elif action.kind is ActionType.BACKWARD_INPUT:
            self._backward(s, i, split=True)
        else:  # BACKWARD_WEIGHT: the deferred part; the micro-batch's graph is freed after it
            with running_backward():
                for work in self._weight_work.pop((s, i)):
                    work.run()
            self._stash.pop((s, i))
            self._stash_bytes.pop((s, i), None)
            self._held_bytes.pop((s, i), None)

    def _recomputed(self, microbatch: int) -> bool:
        return self._schedule.training and self.recompute.applies(microbatch, self._schedule.num_microbatches)

    def _forward(self, s: int, i: int) -> None:
        training = self._schedule.training
        leaves: list[torch.Tensor] = []
        if s == 0:
            x: Any = self._inputs[i]  # type: ignore[index]
        else:
            request = self._received.pop((s, i))
            self.transport.complete(request)
            meta = request.meta
            if meta is None:  # exchange() always sets it; kept for the type checker
                raise RuntimeError(f"No metadata arrived for stage {s}, micro-batch {i}.")
            for tensor, tensor_meta in zip(request.result, meta.tensors, strict=True):
                if training and tensor_meta.carries_grad:
                    tensor.requires_grad_(True)
                    leaves.append(tensor)
            x = tuple(request.result) if meta.is_tuple else request.result[0]
        layers = self.stages[s]
        scope = self._skip_scope(s, i, training)
        saved: dict[tuple[int, int], int] = {}
        memory = (
            torch.autograd.graph.saved_tensors_hooks(_counting_pack(saved), _identity)
            if training and self.measure_activation_memory
            else contextlib.nullcontext()
        )
        recomputed = self._recomputed(i)
        seeds = self._layer_seeds(s, i) if training and self._layer_seeds is not None else None
        if recomputed and self._schedule.splits_backward:
            # Zero-bubble with recomputation: torch's checkpoint recomputes a region once per
            # backward call, and the W pass makes several; so the input-gradient action runs the
            # forward again itself, with this random state, and splits that graph (Replay).
            self._replay[(s, i)] = Replay.capture(x, self.transport.device, seeds, scope)
        with torch.set_grad_enabled(training), memory:
            out = (
                run_recomputed(layers, x, s, seeds, scope)
                if recomputed
                else run_in(scope, layers, x, s, seeds)
            )
        self._hand_on_skips(s, i, scope, training)
        if self.check_finite:
            _check_finite(out, f"the output of pipeline stage {s} for micro-batch {i}")
        if (s, i) in self._replay and s == self.num_stages - 1:
            # The loss starts from leaves standing for the output, so that its input gradient stops
            # there (the replayed forward's graph takes it from there) and never reaches torch's
            # checkpoint graph, which would recompute the stage once more.
            out = _stand_in(out)
            self._replay[(s, i)].output = out
        if s == self.num_stages - 1:
            value = self._head(out, i)  # type: ignore[misc]
            # Keep the graph only in the stash (until this micro-batch's backward): a loss kept
            # with its graph in the result would hold every micro-batch's activations to the end.
            self._result.outputs[i] = (
                value.detach() if training and isinstance(value, torch.Tensor) else value
            )
            if self.check_finite and isinstance(value, torch.Tensor):
                _check_finite(value, f"the loss of micro-batch {i}")
            if training:
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    got = (
                        f"a tensor of shape {tuple(value.shape)}"
                        if isinstance(value, torch.Tensor)
                        else type(value).__name__
                    )
                    raise TypeError(f"The loss of micro-batch {i} must be a scalar tensor, got {got}.")
                self._stash[(s, i)] = (leaves, value)
        else:
            if training:
                # A leaf of this stage's own (its received input, a popped skip) may be passed on:
                # its gradient comes back to it like any root's.
                received = {id(t) for t in (*leaves, *self._popped_leaves(s, i))}
                for k, t in enumerate(_as_tuple(out)):
                    if (
                        t.requires_grad
                        and t.grad_fn is None
                        and not isinstance(t, nn.Parameter)
                        and id(t) not in received
                    ):
                        raise RuntimeError(
                            f"Output {k} of pipeline stage {s} requires grad but has no grad path: it is "
                            "a new leaf tensor, so gradients sent back for it would reach no "
                            "parameter. Compute it from the stage input or parameters, or detach() it."
                        )
            self._outputs[(s, i)] = out
            if training:
                self._stash[(s, i)] = (leaves, out)
        self._result.peak_stashed = max(self._result.peak_stashed, len(self._stash))
        if training and self.measure_activation_memory:
            if recomputed:  # recomputation keeps only the stage input
                saved = {
                    (t.data_ptr(), t.nbytes): t.nbytes for t in _as_tuple(x) if isinstance(t, torch.Tensor)
                }
            self._stash_bytes[(s, i)] = saved
            kept = [*leaves, *_as_tuple(out), *self._popped_leaves(s, i)]
            self._held_bytes[(s, i)] = {**saved, **{(t.data_ptr(), t.nbytes): t.nbytes for t in kept}}
            # A tensor saved by several live micro-batches (a weight kept for the input gradient)
            # exists once: count distinct tensors over all of them.
            for counted, field_name in (
                (self._stash_bytes, "peak_activation_bytes"),
                (self._held_bytes, "peak_held_bytes"),
            ):
                live = sum({k: v for d in counted.values() for k, v in d.items()}.values())
                setattr(self._result, field_name, max(getattr(self._result, field_name), live))

    def _backward(self, s: int, i: int, split: bool = False) -> None:
        """The backward of micro-batch ``i`` on stage ``s``, or with ``split`` (zero-bubble) its
        input-gradient part, leaving the weights' part for the ``BACKWARD_WEIGHT`` action."""
        leaves, out = self._stash[(s, i)] if split else self._stash.pop((s, i))
        if not split:  # a split micro-batch keeps its graph, and counts, until its W
            self._stash_bytes.pop((s, i), None)
            self._held_bytes.pop((s, i), None)
        last = s == self.num_stages - 1
        carries: list[bool]
        if last:
            loss = out
            if not loss.requires_grad:  # type: ignore[union-attr]
                raise RuntimeError(
                    f"The loss of micro-batch {i} does not require grad: it is not computed from "
                    "the pipeline output or the model's parameters."
                )
            weighted = loss * self._weights[i]  # type: ignore[operator]
            if self._scale_loss is not None:  # fp16: gradients scaled, unscaled before the step
                weighted = self._scale_loss(weighted)
            roots: list[torch.Tensor] = [weighted]
            grads: list[torch.Tensor] | None = None
        else:
            meta = self._output_meta.pop((s, i))
            grads = self.transport.complete(self._received.pop((s, i)))
            carries = [tm.carries_grad for tm in meta.tensors]
            roots = [t for t, c in zip(_as_tuple(out), carries, strict=True) if c]
        skip_leaves = self._popped_leaves(s, i)
        skip_roots = self._skip_roots.pop((s, i), None)
        # Forwards recomputed inside backward must not count twice in BatchNorm statistics.
        with running_backward():
            if not split:
                if skip_roots is not None:
                    edges, grads = self._with_skip_roots(s, i, roots, grads, skip_roots)
                    if edges:
                        torch.autograd.backward(edges, grads)
                elif roots:
                    torch.autograd.backward(roots, grads)
            else:
                work: list[WeightGradients] = []
                replay = self._replay.pop((s, i), None)
                if replay is not None:
                    if last:  # the loss's gradient at the stage output, then the stage's own graph
                        outputs = _as_tuple(replay.output)  # type: ignore[arg-type]
                        carries = [t.requires_grad for t in outputs]
                        stand_in = [t for t, c in zip(outputs, carries, strict=True) if c]
                        # The loss's own weights now: one the stage also uses must not be
                        # accumulated by two W passes (the reducer counts each weight once).
                        work.append(backward_input(roots, None, stand_in, defer_weights=False))
                        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in stand_in]
                    again = _as_tuple(replay.run(self.stages[s], s))
                    roots = [t for t, c in zip(again, carries, strict=True) if c]
                    if skip_roots is not None and replay.scope is not None:
                        # The replayed forward stashed again: its graph is the one to go back through.
                        skip_roots = self._stashed_edges(s, replay.scope)
                if skip_roots is not None:
                    edges, grads = self._with_skip_roots(s, i, roots, grads, skip_roots)
                    if edges:
                        work.append(backward_input(edges, grads, leaves + skip_leaves))
                elif roots:
                    work.append(backward_input(roots, grads, leaves + skip_leaves))
                self._weight_work[(s, i)] = work
        if s > 0:
            self._input_grads[(s, i)] = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
            ]
        self._hand_back_skip_grads(s, i)

    # ------------------------------------------------------------------ skip connections
    def _local(self, stage: int) -> bool:
        return self._schedule.stage_to_rank[stage] == self._pp_rank

    def _skip_scope(self, s: int, i: int, training: bool) -> SkipScope:
        """Stage ``s``'s scope for micro-batch ``i``: what it pops (received, or handed on by a
        stage of this rank), as leaves whose gradients go back to the producer."""
        popped: dict[str, torch.Tensor] = {}
        for route in self._skips_into[s]:
            a = route.producer
            if self._local(a):
                tensors: Sequence[torch.Tensor] = self._skip_local.pop((a, s, i))
            else:
                request = self._received_skips.pop((a, s, i))
                tensors = self.transport.complete(request)
                meta = request.meta
                if meta is None:  # exchange() always sets it; kept for the type checker
                    raise RuntimeError(f"No metadata arrived for the skips of stage {a} to stage {s}.")
                for tensor, tensor_meta in zip(tensors, meta.tensors, strict=True):
                    if training and tensor_meta.carries_grad:
                        tensor.requires_grad_(True)
            popped.update(zip(route.names, tensors, strict=True))
            if training:
                self._skip_leaves.setdefault((s, i), []).append((a, [t for t in tensors if _carries(t)]))
        may_stash, may_pop = self._declared[s]
        return SkipScope(popped, may_stash, may_pop, where=f"pipeline stage {s} (micro-batch {i})")

    def _popped_leaves(self, s: int, i: int) -> list[torch.Tensor]:
        """The leaves stage ``s`` popped for micro-batch ``i`` that carry a gradient back."""
        return [t for _, ts in self._skip_leaves.get((s, i), []) for t in ts]

    def _hand_on_skips(self, s: int, i: int, scope: SkipScope, training: bool) -> None:
        """After stage ``s``'s forward: what it stashed for later stages, to send or to hand to a
        stage of this rank (as leaves: their graph stays this stage's, whose backward the
        consumer's gradient joins)."""
        routes = self._skips_from[s]
        for route in routes:
            missing = [name for name in route.names if name not in scope.stashed]
            if missing:
                raise SkipError(
                    f"The layers of pipeline stage {s} declare that they stash {missing}, which stage "
                    f"{route.consumer} pops, but their forward of micro-batch {i} did not stash it: call "
                    "stash(name, tensor) in every forward (a layer that stashes only sometimes cannot be "
                    "split across stages)."
                )
            tensors = tuple(scope.stashed[name] for name in route.names)
            if self._local(route.consumer):
                self._skip_local[(s, route.consumer, i)] = tuple(_leaf(t) for t in tensors)
            else:
                self._skip_out[(s, route.consumer, i)] = tensors
        if training and routes:
            # Only where the gradients go in, not the tensors: their data is freed as soon as
            # nothing else holds it (it was sent, or handed on as a leaf of its own).
            self._skip_roots[(s, i)] = self._stashed_edges(s, scope)

    def _stashed_edges(self, s: int, scope: SkipScope) -> list[tuple[int, list[GradientEdge]]]:
        """Per route out of stage ``s``: the gradient edges of its stashed tensors that carry one."""
        return [
            (
                route.consumer,
                [get_gradient_edge(t) for t in (scope.stashed[n] for n in route.names) if _carries(t)],
            )
            for route in self._skips_from[s]
        ]

    def _with_skip_roots(
        self,
        s: int,
        i: int,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        skip_roots: list[tuple[int, list[GradientEdge]]],
    ) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """``roots`` and ``grads`` with the gradient edges of stage ``s``'s stashed tensors and the
        gradients their consumers sent back; one edge reached several ways (two consumers, or also
        the stage's output) is one root with its gradients summed."""
        if grads is None:  # the last stage stashes nothing for later stages
            raise RuntimeError(f"Stage {s} stashes skips but has no output gradient.")
        # Keyed by the edge's node and output: holding the edges keeps each node's Python object,
        # so the same node is the same object here.
        total: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor]] = {}

        def add(edge: GradientEdge, grad: torch.Tensor) -> None:
            key = (id(edge.node), edge.output_nr)
            known = total.get(key)
            total[key] = (edge, grad if known is None else known[1] + grad)

        for root, grad in zip(roots, grads, strict=True):
            add(get_gradient_edge(root), grad)
        for consumer, edges in skip_roots:
            arrived = self._skip_grads.pop((s, i, consumer))
            received = arrived if isinstance(arrived, list) else self.transport.complete(arrived)
            for edge, grad in zip(edges, received, strict=True):
                add(edge, grad)
        return [e for e, _ in total.values()], [g for _, g in total.values()]

    def _hand_back_skip_grads(self, s: int, i: int) -> None:
        """After stage ``s``'s (input-gradient) backward: its popped tensors' gradients, to send
        to their producers or to hand back to a stage of this rank."""
        for a, leaves in self._skip_leaves.pop((s, i), []):
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
            if self._local(a):
                self._skip_grads[(a, i, s)] = grads
            else:
                self._skip_grads_out[(s, i, a)] = grads

    # ------------------------------------------------------------------ communicate
    def _cache_key(self, boundary: Hashable, i: int) -> Hashable | None:
        if self._signatures is None:
            return None
        # Training and evaluation produce the same shapes but differ in requires_grad.
        return (boundary, self._schedule.training, self._signatures[i])

    def _receive(self, action: Action) -> RecvRequest | None:
        """The request for a receive action; ``None`` when its shapes are not known yet."""
        s, i = action.stage_index, action.microbatch
        peer = self.peers[self._schedule.peer_rank(action)]
        if action.kind is ActionType.RECV_F:
            return RecvRequest(peer, cache_key=self._cache_key(s - 1, i), label=_describe(action))
        # A skip's receive is posted where its message is produced (schedule.lockstep), often long
        # before its use: on gloo the rank goes on computing until then (on CUDA a wait only
        # orders the stream, so there is nothing to gain).
        lazy = self.transport.device.type != "cuda"
        if action.kind is ActionType.RECV_SKIP:
            key = self._cache_key(("skip", action.peer_stage, s), i)
            return RecvRequest(peer, cache_key=key, label=_describe(action), lazy=lazy)
        if action.kind is ActionType.RECV_SKIP_GRAD:
            skip_meta = self._skip_meta.get((s, action.peer_stage, i))  # type: ignore[arg-type]
            if skip_meta is None:
                return None
            return RecvRequest(peer, meta=skip_meta, grad_of=True, label=_describe(action), lazy=lazy)
        meta = self._output_meta.get((s, i))
        if meta is None:
            return None
        return RecvRequest(peer, meta=meta, grad_of=True, label=_describe(action))

    def _communicate(self, batch: list[Action], ahead: list[Action], early: bool) -> None:
        """Post ``batch``'s sends and receives (those not posted early), and, when receiving early,
        the receives of the next exchange ``ahead`` if their shapes are known."""
        sends: list[SendRequest] = []
        recvs: list[RecvRequest] = []
        for action in batch:
            s, i = action.stage_index, action.microbatch
            if action.kind is ActionType.SEND_F:
                peer = self.peers[self._schedule.peer_rank(action)]
                out = self._outputs.pop((s, i))
                meta = ActivationMeta.of(out)
                if self._schedule.training:
                    self._output_meta[(s, i)] = meta
                sends.append(
                    SendRequest(peer, _as_tuple(out), meta, self._cache_key(s, i), label=_describe(action))
                )
            elif action.kind is ActionType.SEND_B:
                peer = self.peers[self._schedule.peer_rank(action)]
                sends.append(SendRequest(peer, self._input_grads.pop((s, i)), label=_describe(action)))
            elif action.kind is ActionType.SEND_SKIP:
                c = action.peer_stage
                peer = self.peers[self._schedule.peer_rank(action)]
                tensors = self._skip_out.pop((s, c, i))  # type: ignore[arg-type]
                meta = ActivationMeta.of(tensors)
                if self._schedule.training:
                    self._skip_meta[(s, c, i)] = meta  # type: ignore[index]
                key = self._cache_key(("skip", s, c), i)
                sends.append(SendRequest(peer, tensors, meta, key, label=_describe(action)))
            elif action.kind is ActionType.SEND_SKIP_GRAD:
                peer = self.peers[self._schedule.peer_rank(action)]
                grads = self._skip_grads_out.pop((s, i, action.peer_stage))  # type: ignore[arg-type]
                sends.append(SendRequest(peer, grads, label=_describe(action)))
            else:
                request = self._early.pop(action, None)
                if request is None:
                    request = self._receive(action)
                    if request is None:  # unreachable: a gradient's sender sent its meta first
                        raise RuntimeError(f"No activation was sent before {_describe(action)}.")
                    recvs.append(request)
                if action.kind is ActionType.RECV_SKIP:
                    self._received_skips[(action.peer_stage, s, i)] = request  # type: ignore[index]
                elif action.kind is ActionType.RECV_SKIP_GRAD:
                    self._skip_grads[(s, i, action.peer_stage)] = request  # type: ignore[index]
                else:
                    self._received[(s, i)] = request
        posted: dict[Action, RecvRequest] = {}
        for action in ahead:
            if action.kind in _RECEIVES:
                request = self._receive(action)
                if request is None or not self.transport.knows(request):
                    # Posting it now would need a header round trip (or the gradient's shape):
                    # leave the whole exchange to its turn, which keeps each channel in order.
                    posted = {}
                    break
                posted[action] = request
        self.transport.exchange(sends, recvs + list(posted.values()), wait=not early)
        self._early.update(posted)
        self.receives_posted_early += len(posted)
