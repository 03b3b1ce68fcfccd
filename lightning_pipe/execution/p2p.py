"""Point-to-point transport of activations and gradients between pipeline neighbours.

An activation is a tensor or a tuple of tensors of any dtype whose shapes may change between
micro-batches and steps, so the receiver is never told shapes in advance. Instead the sender
prefixes a message with a fixed-size *header* (:mod:`.wire`: tuple flag, count, and per tensor its
dtype, whether it requires grad, and its shape) whenever the receiver cannot know the shapes yet.

Headers are cached on both ends under a key that both ends know without talking: the micro-batch's
*signature* (shapes and dtypes of the pipeline input, which every rank of a pipeline sees) and the
stage boundary. When a signature repeats, both ends skip the header and the steady state sends one
message per tensor and nothing else. Gradients never need a header: the stage that receives a
gradient already knows the shape, dtype and grad-requirement of the tensor it sent.

Receives on one channel must be posted in the order of the sends they match (no tags: NCCL has
none), so :meth:`P2PTransport.exchange` drains each channel in order, in rounds: it posts every
receive whose shape is known, up to and including the first header on each channel, waits for the
headers, and repeats. The steady state takes one round.

Where the backend cannot coalesce a batch (gloo), ``torch.distributed.batch_isend_irecv`` is a
Python loop over ``isend``/``irecv``, each of which looks the group up again and maps the peer's
global rank to its group rank before calling the process group's ``send``/``recv``; the transport
calls those directly with the mapping done once per peer (issue 31: a few tens of µs per tensor,
on every exchange). NCCL, which coalesces, still gets ``batch_isend_irecv``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_pipe.execution.wire import HEADER_SIZE, ActivationMeta, check_sendable
from lightning_pipe.faults.board import FaultBoard, lost_connection, underlying


class _Op(NamedTuple):
    """One send or receive of an exchange (``peer``: a global rank)."""

    send: bool
    tensor: torch.Tensor
    peer: int


class PipelineCommunicationError(RuntimeError):
    """A pipeline exchange missed its deadline or lost its peer; the message names both ends."""


@dataclass
class RecvRequest:
    """A receive to perform: from ``peer``, either with known ``meta`` or with a header first.

    ``grad_of`` marks a gradient receive: only the tensors of that meta that carry a gradient
    arrive. After :meth:`P2PTransport.exchange`, ``result`` holds the tensors and ``meta`` is set.
    """

    peer: int
    meta: ActivationMeta | None = None
    cache_key: Hashable | None = None
    grad_of: bool = False
    label: str = "a receive"
    """What this receive is for, for error messages (e.g. ``RECV_F stage 1 micro-batch 3``)."""
    result: list[torch.Tensor] = field(default_factory=list)
    lazy: bool = False
    """Wait for the data only at its first use (:meth:`P2PTransport.complete`) even when the
    exchange waits: a skip connection's receive is posted where its message is produced, which may
    be long before the rank needs it (the header, if one comes, is still waited for)."""
    pending: list[dist.Work] = field(default_factory=list)
    """Posted but not yet waited for (``exchange(..., wait=False)``): :meth:`P2PTransport.complete`
    waits for them before ``result`` is read."""


@dataclass
class SendRequest:
    """A send to ``peer``: ``tensors`` in order, preceded by a header unless the peer knows it."""

    peer: int
    tensors: Sequence[torch.Tensor]
    meta: ActivationMeta | None = None
    cache_key: Hashable | None = None
    label: str = "a send"


class P2PTransport:
    """Posts batched sends and receives to pipeline peers (global ranks) and keeps the header cache.

    Sends are posted and not waited for until :meth:`flush` (at the end of a step): the next
    computation overlaps them, and the tensors are kept alive here until then.
    """

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        owner: str = "this rank",
        board: FaultBoard | None = None,
    ) -> None:
        self.device = device
        self.board = board
        """Names a peer that vanished (or raised) when a connection is lost."""
        self.group = group
        # gloo honours a per-wait deadline; NCCL's host-side wait would block the CPU instead of
        # ordering streams, so there the process group's own timeout (watchdog) is the deadline.
        self.timeout = timeout if device.type != "cuda" else None
        self.owner = owner
        self._sent_headers: dict[Hashable, ActivationMeta] = {}
        self._recv_headers: dict[Hashable, ActivationMeta] = {}
        self._pending: list[tuple[dist.Work, str, int, object]] = []
        self.headers_sent = 0
        self.bytes_sent = 0
        """Bytes of tensors sent so far, headers left out (a counter for tests and benchmarks)."""
        self._direct: dist.ProcessGroup | None = None
        """The process group to call ``send``/``recv`` on directly (a backend that does not
        coalesce); decided at the first exchange, when the group exists."""
        self._resolved = False
        self._group_ranks: dict[int, int] = {}

    def _wait(self, work: dist.Work, label: str, peer: int) -> None:
        """Wait for ``work``; turn a timeout or a dead peer into an error that says who and what."""
        start = time.monotonic()
        try:
            if self.timeout is not None:
                work.wait(self.timeout)
            else:
                work.wait()
        except Exception as err:
            raise self._explain(err, label, [peer], time.monotonic() - start) from None

    def _resolve(self) -> None:
        """Use the process group directly where ``batch_isend_irecv`` would loop over the ops
        itself (its own test: a plain ``ProcessGroup`` whose backend for this device does not
        coalesce)."""
        self._resolved = True
        try:  # torch's private calls: where they change, batch_isend_irecv serves as before
            group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            if type(group) is dist.ProcessGroup and not group._get_backend(self.device).supports_coalescing:
                self._direct = group
        except (AttributeError, RuntimeError, TypeError):
            self._direct = None

    def _post_direct(self, group: dist.ProcessGroup, ops: list[_Op]) -> list[dist.Work]:
        """What ``isend``/``irecv`` end in, without their per-call lookups (tag 0, as theirs)."""
        works = []
        ranks = self._group_ranks
        for op in ops:
            tensor = torch.view_as_real(op.tensor) if op.tensor.is_complex() else op.tensor
            peer = ranks.get(op.peer)
            if peer is None:
                peer = ranks[op.peer] = dist.get_group_rank(group, op.peer)
            works.append(group.send([tensor], peer, 0) if op.send else group.recv([tensor], peer, 0))
        return works

    def _post(self, ops: list[_Op], labels: list[str]) -> list[dist.Work]:
        """Post a batch of sends and receives; a peer that is gone already fails here, on the
        sending side, and gets the same explanation as a failed receive."""
        start = time.monotonic()
        try:
            if not ops:
                return []
            if not self._resolved:
                self._resolve()
            if self._direct is not None:
                return self._post_direct(self._direct, ops)
            return dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, self.group)
                    for op in ops
                ]
            )
        except Exception as err:
            label = "; ".join(dict.fromkeys(labels))
            raise self._explain(
                err, label, sorted({op.peer for op in ops}), time.monotonic() - start
            ) from None

    def _explain(
        self, err: Exception, label: str, peers: list[int], elapsed: float
    ) -> PipelineCommunicationError:
        cause = underlying(err)
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
        if lost_connection(cause):
            hint = self.board.explain_lost(peers) if self.board is not None else f"{who} has stopped"
        else:
            hint = (
                f"{who} did not answer within the deadline: it may be stuck, have failed without "
                "closing its connection, or run a different schedule; raise the strategy's `timeout` "
                "if steps are legitimately slower"
            )
        peer = f"peer rank {peers[0]}" if len(peers) == 1 else f"peer ranks {peers}"
        if self.board is not None:
            self.board.report_victim(f"gave up on {label} with {peer}: {hint}")
        return PipelineCommunicationError(
            f"{self.owner} gave up on {label} with {peer} after {elapsed:.1f}s: {hint}. "
            f"(Underlying error: {cause})"
        )

    def _header_needed_for_send(self, request: SendRequest) -> bool:
        if request.meta is None:
            return False  # a gradient: shapes are known on the other side
        if request.cache_key is None:
            return True
        known = self._sent_headers.get(request.cache_key)
        if known is None:
            self._sent_headers[request.cache_key] = request.meta
            return True
        if known != request.meta:
            raise RuntimeError(
                f"{self.owner}, {request.label}: a stage output changed shape or dtype for an input "
                "of the same shape: it was "
                f"{[(t.shape, t.dtype) for t in known.tensors]} and is now "
                f"{[(t.shape, t.dtype) for t in request.meta.tensors]}. Pipeline stages must produce "
                "outputs whose shapes depend only on the shapes of the pipeline input."
            )
        return False

    def exchange(self, sends: Sequence[SendRequest], recvs: Sequence[RecvRequest], wait: bool = True) -> None:
        """Post ``sends`` and ``recvs``; with ``wait`` block until every receive has arrived,
        otherwise only until the headers have (to size the buffers): :meth:`complete` waits for a
        request's data when it is first used, so the transfer overlaps what runs in between."""
        # Release sends that have completed: holding every sent tensor until the end of the step
        # would keep O(num_microbatches) activations alive whatever the schedule.
        self._pending = [entry for entry in self._pending if not self._completed(entry)]
        ops: list[_Op] = []
        labels: list[str] = []
        keep: list[torch.Tensor] = []
        for send in sends:
            if self._header_needed_for_send(send):
                header = send.meta.encode().to(self.device)  # type: ignore[union-attr]
                keep.append(header)
                ops.append(_Op(True, header, send.peer))
                labels.append(f"{send.label} (header)")
                self.headers_sent += 1
            for index, tensor in enumerate(send.tensors):
                check_sendable(tensor, self.device, send.label, index)
                tensor = tensor.detach().contiguous()
                self.bytes_sent += tensor.nbytes
                keep.append(tensor)
                ops.append(_Op(True, tensor, send.peer))
                labels.append(send.label)

        # Receives per channel, in order; each round posts up to the first unknown header.
        queues: dict[int, list[RecvRequest]] = {}
        for request in recvs:
            if request.meta is None and request.cache_key is not None:
                request.meta = self._recv_headers.get(request.cache_key)
            queues.setdefault(request.peer, []).append(request)
        first_round = True
        while first_round or any(queues.values()):
            headers: list[tuple[RecvRequest, torch.Tensor]] = []
            data: list[tuple[RecvRequest, list[torch.Tensor]]] = []
            recv_owner: list[RecvRequest | None] = []  # per irecv op: its data request, None: header
            for peer, queue in queues.items():
                while queue:
                    request = queue[0]
                    if request.meta is None and request.cache_key is not None:
                        # An earlier receive of this exchange may have brought the header for
                        # this key (two messages of one boundary): the sender sent it only once.
                        request.meta = self._recv_headers.get(request.cache_key)
                    if request.meta is None:
                        header = torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)
                        ops.append(_Op(False, header, peer))
                        labels.append(f"{request.label} (header)")
                        headers.append((request, header))
                        recv_owner.append(None)
                        break
                    queue.pop(0)
                    buffers = [
                        torch.empty(t.shape, dtype=t.dtype, device=self.device)
                        for t in request.meta.tensors
                        if not request.grad_of or t.carries_grad
                    ]
                    ops += [_Op(False, b, peer) for b in buffers]
                    labels += [request.label] * len(buffers)
                    recv_owner += [request] * len(buffers)
                    data.append((request, buffers))
            works = self._post(ops, labels)
            waits: list[tuple[dist.Work, str, int, RecvRequest | None]] = []
            if len(works) == len(ops):
                # gloo: one work per operation; leave the sends in flight.
                owners = iter(recv_owner)
                for work, op, label in zip(works, ops, labels, strict=True):
                    if not op.send:
                        waits.append((work, label, op.peer, next(owners)))
                    else:
                        self._pending.append((work, label, op.peer, keep))
            else:
                # NCCL coalesces a batch into one work; waiting on it only orders the current
                # stream after the transfer (no host synchronisation), so waiting here is cheap.
                label = "; ".join(labels)
                peers = sorted({op.peer for op in ops})
                waits = [(w, label, peers[0], None) for w in works]
                self._pending += [(w, label, peers[0], keep) for w in works]
            for work, label, peer, owner in waits:
                if owner is not None and (not wait or owner.lazy):
                    owner.pending.append(work)  # a data receive: waited for at first use
                else:
                    self._wait(work, label, peer)
            for request, buffers in data:
                request.result = buffers
            for request, header in headers:
                request.meta = ActivationMeta.decode(header.cpu())
                if request.cache_key is not None:
                    self._recv_headers[request.cache_key] = request.meta
            ops, labels, keep, first_round = [], [], [], False

    def knows(self, request: RecvRequest) -> bool:
        """Whether ``request`` can be posted without a header (its shapes are known here)."""
        return request.meta is not None or (
            request.cache_key is not None and request.cache_key in self._recv_headers
        )

    def complete(self, request: RecvRequest) -> list[torch.Tensor]:
        """Wait for ``request``'s data (posted with ``wait=False``) and return it."""
        while request.pending:
            self._wait(request.pending.pop(0), request.label, request.peer)
        return request.result

    def _completed(self, entry: tuple[dist.Work, str, int, object]) -> bool:
        work, label, peer, _ = entry
        try:
            return bool(work.is_completed())
        except Exception as err:  # a send whose peer has gone
            raise self._explain(err, label, [peer], 0.0) from None

    def flush(self) -> None:
        """Wait for every posted send (end of step) and release their buffers."""
        try:
            for work, label, peer, _ in self._pending:
                self._wait(work, label, peer)
        finally:
            self._pending.clear()
