"""One step's messages on a pipeline rank: what the interpreter's computations leave to send and
the receives they take, posted one exchange (a run of consecutive communication actions) at a
time through :class:`~lightning_pipe.execution.p2p.P2PTransport`.

Receives may be posted one exchange early (:func:`receives_early`), so that their transfer
overlaps the computation in between; a receive is then waited for only when its data is first
used.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from lightning_pipe.execution.activation import Activation, as_tuple
from lightning_pipe.execution.p2p import P2PTransport, RecvRequest, SendRequest
from lightning_pipe.execution.skip_routing import SkipRouting
from lightning_pipe.execution.wire import ActivationMeta
from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule

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


def describe(action: Action) -> str:
    """``action`` in words, for error messages: what, which stage, which micro-batch."""
    other = "" if action.peer_stage is None else f" (other end: stage {action.peer_stage})"
    return (
        f"{_WHAT[action.kind]} stage {action.stage_index}, micro-batch {action.microbatch}{other} ({action})"
    )


_RECEIVES = (ActionType.RECV_F, ActionType.RECV_B, ActionType.RECV_SKIP, ActionType.RECV_SKIP_GRAD)


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


class StepMessages:
    """One step's messages: stage outputs and input gradients to send, the receives posted.

    Args:
        transport: posts the exchanges.
        peers: global rank of every pipeline rank of this pipeline, indexed by ``pp_rank``.
        skips: the skip connections' routing, which keeps their messages.
    """

    def __init__(self, transport: P2PTransport, peers: Sequence[int], skips: SkipRouting) -> None:
        self.transport = transport
        self.peers = peers
        self.skips = skips
        self._schedule: PipelineSchedule | None = None
        self._signatures: Sequence[Hashable] | None = None
        self.reset()

    def begin(self, schedule: PipelineSchedule, signatures: Sequence[Hashable] | None) -> None:
        """Exchange the messages of ``schedule``'s step (``signatures``: see ``PipelineExecutor.run``)."""
        self._schedule, self._signatures = schedule, signatures

    def reset(self) -> None:
        """Forget one step's messages."""
        self.received: dict[tuple[int, int], RecvRequest] = {}
        """(stage, micro-batch) -> the receive of its stage input or output gradient."""
        self._early: dict[Action, RecvRequest] = {}
        self.outputs: dict[tuple[int, int], Activation] = {}
        """(stage, micro-batch) -> the stage output to send."""
        self.output_meta: dict[tuple[int, int], ActivationMeta] = {}
        """(stage, micro-batch) -> the description of the output sent (for its gradient's receive)."""
        self.input_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        """(stage, micro-batch) -> the gradients of the stage input to send back."""

    @property
    def schedule(self) -> PipelineSchedule:
        if self._schedule is None:
            raise RuntimeError("No step is running: StepMessages.begin() was not called.")
        return self._schedule

    def take_input(self, s: int, i: int, training: bool) -> tuple[Activation, list[torch.Tensor]]:
        """Stage ``s``'s received input for micro-batch ``i`` and, when ``training``, its tensors
        that carry a gradient back (made leaves that require grad)."""
        request = self.received.pop((s, i))
        self.transport.complete(request)
        meta = request.meta
        if meta is None:  # exchange() always sets it; kept for the type checker
            raise RuntimeError(f"No metadata arrived for stage {s}, micro-batch {i}.")
        leaves: list[torch.Tensor] = []
        for tensor, tensor_meta in zip(request.result, meta.tensors, strict=True):
            if training and tensor_meta.carries_grad:
                tensor.requires_grad_(True)
                leaves.append(tensor)
        return (tuple(request.result) if meta.is_tuple else request.result[0]), leaves

    def _cache_key(self, boundary: Hashable, i: int) -> Hashable | None:
        if self._signatures is None:
            return None
        # Training and evaluation produce the same shapes but differ in requires_grad.
        return (boundary, self.schedule.training, self._signatures[i])

    def _receive(self, action: Action) -> RecvRequest | None:
        """The request for a receive action; ``None`` when its shapes are not known yet."""
        s, i = action.stage_index, action.microbatch
        peer = self.peers[self.schedule.peer_rank(action)]
        if action.kind is ActionType.RECV_F:
            return RecvRequest(peer, cache_key=self._cache_key(s - 1, i), label=describe(action))
        # A skip's receive is posted where its message is produced (schedule.lockstep), often long
        # before its use: on gloo the rank goes on computing until then (on CUDA a wait only
        # orders the stream, so there is nothing to gain).
        lazy = self.transport.device.type != "cuda"
        if action.kind is ActionType.RECV_SKIP:
            key = self._cache_key(("skip", action.peer_stage, s), i)
            return RecvRequest(peer, cache_key=key, label=describe(action), lazy=lazy)
        if action.kind is ActionType.RECV_SKIP_GRAD:
            skip_meta = self.skips.sent_meta(s, action.peer_stage, i)  # type: ignore[arg-type]
            if skip_meta is None:
                return None
            return RecvRequest(peer, meta=skip_meta, grad_of=True, label=describe(action), lazy=lazy)
        meta = self.output_meta.get((s, i))
        if meta is None:
            return None
        return RecvRequest(peer, meta=meta, grad_of=True, label=describe(action))

    def communicate(self, batch: list[Action], ahead: list[Action], early: bool) -> int:
        """Post ``batch``'s sends and receives (those not posted early), and, when receiving early,
        the receives of the next exchange ``ahead`` if their shapes are known; returns how many
        receives were posted early."""
        schedule = self.schedule
        sends: list[SendRequest] = []
        recvs: list[RecvRequest] = []
        for action in batch:
            s, i = action.stage_index, action.microbatch
            if action.kind is ActionType.SEND_F:
                peer = self.peers[schedule.peer_rank(action)]
                out = self.outputs.pop((s, i))
                meta = ActivationMeta.of(out)
                if schedule.training:
                    self.output_meta[(s, i)] = meta
                sends.append(
                    SendRequest(peer, as_tuple(out), meta, self._cache_key(s, i), label=describe(action))
                )
            elif action.kind is ActionType.SEND_B:
                peer = self.peers[schedule.peer_rank(action)]
                sends.append(SendRequest(peer, self.input_grads.pop((s, i)), label=describe(action)))
            elif action.kind is ActionType.SEND_SKIP:
                c = action.peer_stage
                peer = self.peers[schedule.peer_rank(action)]
                tensors, meta = self.skips.send(s, c, i, schedule.training)  # type: ignore[arg-type]
                key = self._cache_key(("skip", s, c), i)
                sends.append(SendRequest(peer, tensors, meta, key, label=describe(action)))
            elif action.kind is ActionType.SEND_SKIP_GRAD:
                peer = self.peers[schedule.peer_rank(action)]
                grads = self.skips.send_grads(s, i, action.peer_stage)  # type: ignore[arg-type]
                sends.append(SendRequest(peer, grads, label=describe(action)))
            else:
                request = self._early.pop(action, None)
                if request is None:
                    request = self._receive(action)
                    if request is None:  # unreachable: a gradient's sender sent its meta first
                        raise RuntimeError(f"No activation was sent before {describe(action)}.")
                    recvs.append(request)
                if action.kind is ActionType.RECV_SKIP:
                    self.skips.receiving(action.peer_stage, s, i, request)  # type: ignore[arg-type]
                elif action.kind is ActionType.RECV_SKIP_GRAD:
                    self.skips.receiving_grads(s, i, action.peer_stage, request)  # type: ignore[arg-type]
                else:
                    self.received[(s, i)] = request
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
        return len(posted)
