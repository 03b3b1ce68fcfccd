"""Skip connections routed through one rank's step (:mod:`lightning_pipe.skip`).

Each stage's forward runs in a :class:`~lightning_pipe.skip.scope.SkipScope` that holds what it
may pop (received like an input, or handed on by a stage of this rank: a leaf whose gradient goes
back) and collects what it stashes (sent like an output, or handed on; an extra root of the
stage's backward, whose gradient comes back from each consumer). :class:`SkipRouting` keeps that
state for one step, composed into the interpreter (:class:`~.executor.PipelineExecutor`), which
calls it around each forward and backward and for the skip messages of each exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_pipe.execution.activation import carries_grad, leaf
from lightning_pipe.execution.p2p import P2PTransport, RecvRequest
from lightning_pipe.execution.wire import ActivationMeta
from lightning_pipe.schedule.actions import PipelineSchedule
from lightning_pipe.skip.layers import SkipDeclaration
from lightning_pipe.skip.plan import SkipRoute
from lightning_pipe.skip.scope import SkipError, SkipScope

SkipRoots = list[tuple[int, list[GradientEdge]]]
"""Per route out of a stage: its consumer and the gradient edges of the stashed tensors."""


class SkipRouting:
    """The skip connections of the stages this rank holds, and their state during one step.

    Args:
        stages: the stage indices this rank holds.
        routes: every route of the pipeline (also those between other ranks' stages).
        declarations: stage index -> what its layers declare they stash and pop.
        transport: completes the receives of skip tensors and their gradients.
    """

    def __init__(
        self,
        stages: Iterable[int],
        routes: Sequence[SkipRoute],
        declarations: dict[int, SkipDeclaration] | None,
        transport: P2PTransport,
    ) -> None:
        held = list(stages)
        self.routes = tuple(routes)
        self.pairs = tuple(sorted((r.producer, r.consumer) for r in self.routes))
        """(producer, consumer) of every route, as a schedule's ``skips``."""
        self._from = {s: [r for r in self.routes if r.producer == s] for s in held}
        self._into = {s: [r for r in self.routes if r.consumer == s] for s in held}
        declared = {s: (declarations or {}).get(s, SkipDeclaration()) for s in held}
        # Frozen once: each forward's scope takes them as they are (no copy per micro-batch).
        self._declared = {s: (frozenset(d.stash), frozenset(d.pop)) for s, d in declared.items()}
        self.transport = transport
        self._stage_to_rank: tuple[int, ...] = ()
        self._pp_rank = -1
        self.reset()

    def begin(self, schedule: PipelineSchedule, pp_rank: int) -> None:
        """Route the step of ``schedule`` that ``pp_rank`` (this rank) runs."""
        self._stage_to_rank, self._pp_rank = schedule.stage_to_rank, pp_rank

    def reset(self) -> None:
        """Forget one step's state."""
        # Keyed (producer, consumer, micro-batch): tensors handed to a consumer on this rank,
        # tensors to send, what was sent (for the gradient's receive), gradients handed back on
        # this rank or received; per (stage, micro-batch): the consumer's leaves and the
        # producer's stashed tensors and routes, which its backward starts from.
        self._local_tensors: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._out: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self._meta: dict[tuple[int, int, int], ActivationMeta] = {}
        self._grads: dict[tuple[int, int, int], list[torch.Tensor] | RecvRequest] = {}
        self._grads_out: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._leaves: dict[tuple[int, int], list[tuple[int, list[torch.Tensor]]]] = {}
        self._roots: dict[tuple[int, int], SkipRoots] = {}
        self._received: dict[tuple[int, int, int], RecvRequest] = {}

    def _local(self, stage: int) -> bool:
        return self._stage_to_rank[stage] == self._pp_rank

    # ------------------------------------------------------------------ forward
    def scope(self, s: int, i: int, training: bool) -> SkipScope:
        """Stage ``s``'s scope for micro-batch ``i``: what it pops (received, or handed on by a
        stage of this rank), as leaves whose gradients go back to the producer."""
        popped: dict[str, torch.Tensor] = {}
        for route in self._into[s]:
            a = route.producer
            if self._local(a):
                tensors: Sequence[torch.Tensor] = self._local_tensors.pop((a, s, i))
            else:
                request = self._received.pop((a, s, i))
                tensors = self.transport.complete(request)
                meta = request.meta
                if meta is None:  # exchange() always sets it; kept for the type checker
                    raise RuntimeError(f"No metadata arrived for the skips of stage {a} to stage {s}.")
                for tensor, tensor_meta in zip(tensors, meta.tensors, strict=True):
                    if training and tensor_meta.carries_grad:
                        tensor.requires_grad_(True)
            popped.update(zip(route.names, tensors, strict=True))
            if training:
                self._leaves.setdefault((s, i), []).append((a, [t for t in tensors if carries_grad(t)]))
        may_stash, may_pop = self._declared[s]
        return SkipScope(popped, may_stash, may_pop, where=f"pipeline stage {s} (micro-batch {i})")

    def popped_leaves(self, s: int, i: int) -> list[torch.Tensor]:
        """The leaves stage ``s`` popped for micro-batch ``i`` that carry a gradient back."""
        return [t for _, ts in self._leaves.get((s, i), []) for t in ts]

    def hand_on(self, s: int, i: int, scope: SkipScope, training: bool) -> None:
        """After stage ``s``'s forward: what it stashed for later stages, to send or to hand to a
        stage of this rank (as leaves: their graph stays this stage's, whose backward the
        consumer's gradient joins)."""
        routes = self._from[s]
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
                self._local_tensors[(s, route.consumer, i)] = tuple(leaf(t) for t in tensors)
            else:
                self._out[(s, route.consumer, i)] = tensors
        if training and routes:
            # Only where the gradients go in, not the tensors: their data is freed as soon as
            # nothing else holds it (it was sent, or handed on as a leaf of its own).
            self._roots[(s, i)] = self.stashed_edges(s, scope)

    # ------------------------------------------------------------------ backward
    def stashed_edges(self, s: int, scope: SkipScope) -> SkipRoots:
        """Per route out of stage ``s``: the gradient edges of its stashed tensors that carry one."""
        return [
            (
                route.consumer,
                [get_gradient_edge(t) for t in (scope.stashed[n] for n in route.names) if carries_grad(t)],
            )
            for route in self._from[s]
        ]

    def take_roots(self, s: int, i: int) -> SkipRoots | None:
        """What stage ``s`` stashed for micro-batch ``i`` (``None``: it stashed nothing), from
        which its backward also starts."""
        return self._roots.pop((s, i), None)

    def with_roots(
        self,
        s: int,
        i: int,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        skip_roots: SkipRoots,
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
            arrived = self._grads.pop((s, i, consumer))
            received = arrived if isinstance(arrived, list) else self.transport.complete(arrived)
            for edge, grad in zip(edges, received, strict=True):
                add(edge, grad)
        return [e for e, _ in total.values()], [g for _, g in total.values()]

    def hand_back_grads(self, s: int, i: int) -> None:
        """After stage ``s``'s (input-gradient) backward: its popped tensors' gradients, to send
        to their producers or to hand back to a stage of this rank."""
        for a, leaves in self._leaves.pop((s, i), []):
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
            if self._local(a):
                self._grads[(a, i, s)] = grads
            else:
                self._grads_out[(s, i, a)] = grads

    # ------------------------------------------------------------------ messages
    def send(self, s: int, c: int, i: int, training: bool) -> tuple[tuple[torch.Tensor, ...], ActivationMeta]:
        """What stage ``s`` sends to stage ``c`` for micro-batch ``i``, and its description (kept
        when training, for the receive of its gradient)."""
        tensors = self._out.pop((s, c, i))
        meta = ActivationMeta.of(tensors)
        if training:
            self._meta[(s, c, i)] = meta
        return tensors, meta

    def sent_meta(self, s: int, c: int, i: int) -> ActivationMeta | None:
        """The description of what stage ``s`` sent to ``c`` for micro-batch ``i`` (``None``: not
        sent yet)."""
        return self._meta.get((s, c, i))

    def send_grads(self, s: int, i: int, a: int) -> list[torch.Tensor]:
        """The gradients stage ``s`` sends back to producer ``a`` for micro-batch ``i``."""
        return self._grads_out.pop((s, i, a))

    def receiving(self, a: int, s: int, i: int, request: RecvRequest) -> None:
        """``request`` receives what stage ``a`` sent stage ``s`` for micro-batch ``i``."""
        self._received[(a, s, i)] = request

    def receiving_grads(self, s: int, i: int, c: int, request: RecvRequest) -> None:
        """``request`` receives the gradients consumer ``c`` sends back to stage ``s``."""
        self._grads[(s, i, c)] = request
