"""The one interpreter that runs any schedule on one pipeline rank.

It walks the rank's action list: a forward runs the stage's layers on a micro-batch and stashes
what backward needs, a backward pops the stash and drives autograd (from the loss on the last
stage, from the received output gradient elsewhere), and each run of consecutive communication
actions is posted as one batch (:mod:`.exchange`).

Gradients accumulate in ``.grad`` across micro-batches; the last stage scales each micro-batch's
loss by its weight (by default ``1 / num_microbatches``, or its share of the samples), so the
accumulated gradient equals the whole batch's on one device.

Skip connections (:mod:`lightning_pipe.skip`) ride along: each stage's forward runs in a
:class:`~lightning_pipe.skip.scope.SkipScope` that holds what it may pop (received like an input,
a leaf whose gradient goes back) and collects what it stashes (sent like an output, an extra root
of the stage's backward, whose gradient comes back from each consumer); :mod:`.skip_routing`
keeps that state for a step. :mod:`.memory` meters the activation memory when asked to.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.activation import Activation, as_tuple, stand_in
from lightning_pipe.execution.batchnorm import running_backward
from lightning_pipe.execution.checks import check_finite, check_grad_paths, check_loss
from lightning_pipe.execution.exchange import StepMessages, describe, receives_early
from lightning_pipe.execution.memory import ActivationMeter, Counted, counting_saved
from lightning_pipe.execution.p2p import P2PTransport
from lightning_pipe.execution.recompute import RecomputeMode, Replay, run_in, run_recomputed
from lightning_pipe.execution.skip_routing import SkipRouting
from lightning_pipe.execution.split_backward import WeightGradients, backward_input
from lightning_pipe.faults.board import FaultBoard
from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule, comm_batches
from lightning_pipe.skip.layers import SkipDeclaration
from lightning_pipe.skip.plan import SkipRoute


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


class ActionRecorder(Protocol):
    """The timeline's hook: stamps taken around each action (a communication batch's span for
    each of its actions), in the recorder's clock (:mod:`lightning_pipe.execution.stamps`)."""

    def stamp(self) -> Any: ...

    def __call__(self, action: Action, start: Any, end: Any) -> None: ...


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(note)


_BACKWARDS = (ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)


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
        self.num_stages = num_stages
        self.peers = list(peers)
        self.recompute = RecomputeMode.parse(recompute)
        self.check_finite = check_finite
        self.transport = P2PTransport(device, group, timeout, board=board)
        self._skips = SkipRouting(self.stages, self.skips, skip_declarations, self.transport)
        self._messages = StepMessages(self.transport, self.peers, self._skips)
        self._memory = ActivationMeter()
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
        self._messages.reset()
        self._skips.reset()
        self._memory.reset()
        # (stage, micro-batch) -> what its backward needs: the stage's received leaves and its
        # output (the loss on the last stage); a recomputed zero-bubble forward's replay; the
        # deferred weight-gradient work of a split backward.
        self._stash: dict[tuple[int, int], tuple[list[torch.Tensor], Activation]] = {}
        self._replay: dict[tuple[int, int], Replay] = {}
        self._weight_work: dict[tuple[int, int], list[WeightGradients]] = {}
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
        if schedule.skips != self._skips.pairs:
            raise ValueError(
                f"The schedule has skip connections between stages {list(schedule.skips)}, the executor "
                f"{list(self._skips.pairs)}: build the schedule with the executor's routes "
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
        self._skips.begin(schedule, pp_rank)
        self._messages.begin(schedule, signatures)
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
                start = recorder.stamp() if recorder is not None else None
                if batch[0].kind.is_compute:
                    try:
                        self._compute(batch[0])
                    except Exception as err:
                        _add_note(err, f"{self.transport.owner} was running {describe(batch[0])}.")
                        raise
                else:
                    ahead = following[position] if early else []
                    self.receives_posted_early += self._messages.communicate(batch, ahead, early)
                if recorder is not None:
                    end = recorder.stamp()
                    for action in batch:
                        recorder(action, start, end)
            self.transport.flush()
            self._result.peak_activation_bytes = self._memory.peak_saved
            self._result.peak_held_bytes = self._memory.peak_held
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
            self._memory.release((s, i))

    def _recomputed(self, microbatch: int) -> bool:
        return self._schedule.training and self.recompute.applies(microbatch, self._schedule.num_microbatches)

    def _forward(self, s: int, i: int) -> None:
        training = self._schedule.training
        leaves: list[torch.Tensor] = []
        if s == 0:
            x: Any = self._inputs[i]  # type: ignore[index]
        else:
            x, leaves = self._messages.take_input(s, i, training)
        layers = self.stages[s]
        scope = self._skips.scope(s, i, training)
        saved: Counted = {}
        memory = counting_saved(saved, training and self.measure_activation_memory)
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
        self._skips.hand_on(s, i, scope, training)
        if self.check_finite:
            check_finite(out, f"the output of pipeline stage {s} for micro-batch {i}")
        if (s, i) in self._replay and s == self.num_stages - 1:
            # The loss starts from leaves standing for the output, so that its input gradient stops
            # there (the replayed forward's graph takes it from there) and never reaches torch's
            # checkpoint graph, which would recompute the stage once more.
            out = stand_in(out)
            self._replay[(s, i)].output = out
        if s == self.num_stages - 1:
            value = self._head(out, i)  # type: ignore[misc]
            # Keep the graph only in the stash (until this micro-batch's backward): a loss kept
            # with its graph in the result would hold every micro-batch's activations to the end.
            self._result.outputs[i] = (
                value.detach() if training and isinstance(value, torch.Tensor) else value
            )
            if self.check_finite and isinstance(value, torch.Tensor):
                check_finite(value, f"the loss of micro-batch {i}")
            if training:
                check_loss(value, i)
                self._stash[(s, i)] = (leaves, value)
        else:
            if training:
                check_grad_paths(out, s, (*leaves, *self._skips.popped_leaves(s, i)))
            self._messages.outputs[(s, i)] = out
            if training:
                self._stash[(s, i)] = (leaves, out)
        self._result.peak_stashed = max(self._result.peak_stashed, len(self._stash))
        if training and self.measure_activation_memory:
            kept = [*leaves, *as_tuple(out), *self._skips.popped_leaves(s, i)]
            self._memory.measure((s, i), saved, kept, recomputed, x)

    def _backward(self, s: int, i: int, split: bool = False) -> None:
        """The backward of micro-batch ``i`` on stage ``s``, or with ``split`` (zero-bubble) its
        input-gradient part, leaving the weights' part for the ``BACKWARD_WEIGHT`` action."""
        leaves, out = self._stash[(s, i)] if split else self._stash.pop((s, i))
        if not split:  # a split micro-batch keeps its graph, and counts, until its W
            self._memory.release((s, i))
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
            meta = self._messages.output_meta.pop((s, i))
            grads = self.transport.complete(self._messages.received.pop((s, i)))
            carries = [tm.carries_grad for tm in meta.tensors]
            roots = [t for t, c in zip(as_tuple(out), carries, strict=True) if c]
        skip_leaves = self._skips.popped_leaves(s, i)
        skip_roots = self._skips.take_roots(s, i)
        # Forwards recomputed inside backward must not count twice in BatchNorm statistics.
        with running_backward():
            if not split:
                if skip_roots is not None:
                    edges, grads = self._skips.with_roots(s, i, roots, grads, skip_roots)
                    if edges:
                        torch.autograd.backward(edges, grads)
                elif roots:
                    torch.autograd.backward(roots, grads)
            else:
                work: list[WeightGradients] = []
                replay = self._replay.pop((s, i), None)
                if replay is not None:
                    if last:  # the loss's gradient at the stage output, then the stage's own graph
                        outputs = as_tuple(replay.output)  # type: ignore[arg-type]
                        carries = [t.requires_grad for t in outputs]
                        stand_in = [t for t, c in zip(outputs, carries, strict=True) if c]
                        # The loss's own weights now: one the stage also uses must not be
                        # accumulated by two W passes (the reducer counts each weight once).
                        work.append(backward_input(roots, None, stand_in, defer_weights=False))
                        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in stand_in]
                    replayed: Counted = {}
                    with counting_saved(replayed, self.measure_activation_memory):
                        again = as_tuple(replay.run(self.stages[s], s))
                    if self.measure_activation_memory:  # held with the micro-batch until its W
                        self._memory.add_replayed((s, i), replayed, again)
                    roots = [t for t, c in zip(again, carries, strict=True) if c]
                    if skip_roots is not None and replay.scope is not None:
                        # The replayed forward stashed again: its graph is the one to go back through.
                        skip_roots = self._skips.stashed_edges(s, replay.scope)
                if skip_roots is not None:
                    edges, grads = self._skips.with_roots(s, i, roots, grads, skip_roots)
                    if edges:
                        work.append(backward_input(edges, grads, leaves + skip_leaves))
                elif roots:
                    work.append(backward_input(roots, grads, leaves + skip_leaves))
                self._weight_work[(s, i)] = work
        if s > 0:
            self._messages.input_grads[(s, i)] = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
            ]
        self._skips.hand_back_grads(s, i)
