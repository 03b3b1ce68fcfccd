"""Split one stage's backward into the input gradient (I) and the weight gradient (W).

Zero-bubble schedules (Qi et al. 2023, arXiv:2401.10241) send the gradient of a stage's input
upstream as soon as it exists and compute the weights' gradients later, in what would otherwise be
a bubble. Autograd computes both in one pass, so the split is made on the graph:

* Nodes of the stage's autograd graph that lead to the stage *input* form the input path. The I
  pass runs ``backward`` with the input leaves as ``inputs``: the engine runs exactly the input
  path and, in each node, only the outputs it needs (``AddmmBackward`` computes the input's
  gradient and skips the weight's matmul).
* Every weight is reached from the input path through nodes that lead to weights only. The node
  of the input path where that happens is the weight's *owner*; a pre-hook on it records, during
  the I pass, the gradient that flowed into it. One walk of the graph before the I pass finds the
  input path, the weights and (one sweep back) each weight's owner and the owner's edges towards
  it: linear in the graph's size, once per micro-batch.
* W computes each owner's weight-side gradients from that recorded gradient and what the owner
  saved, with autograd's own formula for the node (:mod:`.weight_rules`, bitwise equal), and runs
  the weight-only nodes below all owners in *one* backward call started from those edges. An
  owner without a rule (or whose rule declines, e.g. its saved tensors have hooks) is re-run
  through autograd instead, from the recorded gradient with only its own weights as ``inputs``.
  Either way nothing of the input path runs again. Weights hanging off the output directly are
  owned by the output itself and get the ordinary backward in W; so does the whole backward of a
  stage without a grad-requiring input (the first stage).
* A weight reached from *two* owners (a weight used twice in a stage, or a tied copy in it) would
  get its second owner's part twice if each owner's W pass were allowed to walk to it (the double
  counting of torch's zero-bubble stages, pytorch #181365). Such weights get their whole gradient
  in the I pass instead, with the input: slower, never wrong. So do weights whose owner is a
  custom ``autograd.Function`` (its Python backward computes every gradient whatever is needed,
  so running it again in W would repeat its work and its side effects, collectives included).
  W's backward calls name their weights as ``inputs``, so these are never accumulated twice.
* A graph holding torch's *reentrant* checkpoint cannot be run with ``inputs=`` at all: such a
  stage gets its whole ordinary backward in I, and W has nothing left to do.
* W starts from the gradient recorded *after* the tensor hooks on the owner's output ran: a rule
  consumes it directly, and a re-run owner gets it back from a pre-hook, so those hooks do not
  apply twice.
* W's calls come in one order on every rank (the output's own pass, the rules' call, then the
  re-run owners in the graph's post-order), so tensor-parallel collectives inside them stay
  matched across ranks.

Gradients land in ``.grad`` through the engine's ``AccumulateGrad`` (not ``autograd.grad``), so
post-accumulate-grad hooks (the data-parallel reducer's) fire as usual. The I pass keeps the graph
(``retain_graph=True``) for W; the graph, with everything it saved, is freed when W is done and
the executor drops the micro-batch's stash, which is why a micro-batch counts as in flight from
its forward to its W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import graph as autograd_graph
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils.checkpoint import CheckpointFunction

from lightning_pipe.execution.compile import keeping_graph
from lightning_pipe.execution.weight_rules import weight_side

_ROOT = object()
"""The owner of weights reached from the stage output without passing the input path."""
_MANY = object()
"""The owner of a node reached from more than one owner: the weights below it are computed in I."""


@dataclass
class _WeightPass:
    """One backward call of the W pass."""

    outputs: list[torch.Tensor | GradientEdge]
    grads: list[torch.Tensor | None]
    weights: list[torch.Tensor] | None
    """The weights this pass computes (``None``: everything the outputs lead to)."""
    owner: Node | None = None
    """The input-path node re-run from ``grads`` (``None``: the stage output itself)."""
    recorded: tuple[torch.Tensor | None, ...] = ()

    def run(self) -> None:
        handle = None
        if self.owner is not None:
            # Tensor hooks on the owner's output already shaped the recorded gradient; node
            # pre-hooks run after them, so this one discards their second application.
            recorded = self.recorded
            handle = self.owner.register_prehook(lambda _grads: recorded)
        try:
            with keeping_graph():
                torch.autograd.backward(self.outputs, self.grads, inputs=self.weights, retain_graph=True)  # type: ignore[arg-type]
        finally:
            if handle is not None:
                handle.remove()


@dataclass
class _Owner:
    """An input-path node with deferred weights, and what the I pass recorded for it."""

    node: Node
    edges: list[int]
    """Its next edges that leave the input path towards its weights."""
    weights: list[torch.Tensor]
    recorded: tuple[torch.Tensor | None, ...] | None = None

    def record(self, grads_in: tuple[torch.Tensor | None, ...]) -> None:
        self.recorded = grads_in

    def as_pass(self) -> _WeightPass | None:
        """The owner's own backward call (no rule for it); ``None``: nothing reached it in I."""
        if self.recorded is None:
            return None
        slots = [(k, g) for k, g in enumerate(self.recorded) if g is not None]
        if not slots:
            return None
        edges: list[torch.Tensor | GradientEdge] = [GradientEdge(self.node, k) for k, _ in slots]
        return _WeightPass(edges, [g for _, g in slots], self.weights, self.node, self.recorded)


@dataclass
class WeightGradients:
    """What the I pass leaves for the W pass: the output's own weights (``passes``) and the owners
    of the others, in the graph's post-order, the same on every tensor-parallel rank (whose W
    passes may hold collectives), so the ranks' calls and their collectives come in one order."""

    passes: list[_WeightPass] = field(default_factory=list)
    owners: list[_Owner] = field(default_factory=list)

    def run(self) -> None:
        """Accumulate the deferred weights' gradients into their ``.grad``."""
        for p in self.passes:
            p.run()
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        slow: list[_WeightPass] = []
        with torch.no_grad():  # once for all owners: the rules record no graph
            for owner in self.owners:
                if owner.recorded is None:  # no gradient reached it: its weights get none, as in one backward
                    continue
                pairs = weight_side(owner.node, owner.recorded, owner.edges)
                if pairs is None:
                    fallback = owner.as_pass()
                    if fallback is not None:
                        slow.append(fallback)
                    continue
                for edge, grad in pairs:
                    edges.append(edge)
                    grads.append(grad)
                weights += owner.weights
        if edges:
            # One call for every ruled owner: autograd walks only the weight-only subgraphs below
            # the edges. inputs= keeps weights computed in I (reached from two owners, or owned by a
            # custom Function) from getting a second part here. The engine is entered directly:
            # torch.autograd.backward's Python check of each root's shape against its grad costs
            # more than the rest of the call with a few hundred roots, and the rules' gradients
            # have their edges' shapes by construction (the engine validates them again in C++).
            # Autograd's private engine entry, which torch.autograd.backward ends in; the public
            # call is the fallback where a torch version lacks it.
            engine = getattr(autograd_graph, "_engine_run_backward", None)
            if engine is not None:
                with keeping_graph():
                    engine(
                        tuple(edges),
                        tuple(grads),
                        True,
                        False,
                        tuple(weights),
                        allow_unreachable=True,
                        accumulate_grad=True,
                    )
            else:  # a torch without the private entry: the public call, same result
                with keeping_graph():
                    torch.autograd.backward(edges, grads, retain_graph=True, inputs=weights)
        for p in slow:
            p.run()
        self.passes.clear()
        self.owners.clear()


class _Kind:
    """What a node's class says about it (cached per class: the walk meets thousands of nodes)."""

    OTHER, LEAF, CUSTOM, REENTRANT = range(4)


_kinds: dict[type, int] = {}


def _kind(node: Node) -> int:
    kind = _kinds.get(type(node))
    if kind is None:
        if hasattr(node, "variable"):  # AccumulateGrad: where a leaf tensor's gradient lands
            kind = _Kind.LEAF
        elif getattr(node, "_forward_cls", None) is CheckpointFunction:
            kind = _Kind.REENTRANT
        elif isinstance(node, BackwardCFunction):  # a custom autograd.Function: its backward runs in full
            kind = _Kind.CUSTOM
        else:
            kind = _Kind.OTHER
        _kinds[type(node)] = kind
    return kind


@dataclass
class _Graph:
    order: list[Node]
    """Every node reachable from the roots, each after all of its children."""
    on_path: set[Node]
    """The input path: nodes that lead to a stage input."""
    path: list[Node]
    """The input path in post-order (deterministic, unlike the set)."""
    leaves: list[Node]
    """``AccumulateGrad`` nodes off the input path: the weights'."""
    reentrant: bool


def _walk(roots: Sequence[Node], input_nodes: set[Node]) -> _Graph:
    """One iterative depth-first walk: post-order, input-path marking and the weights' leaves.

    A node is on the input path when it is a stage input or one of its children is; its children
    are all finished before it (the graph is a DAG), so each open node carries an "on the path"
    flag that its finished or already-seen children set. The walk touches every node once and
    costs about 2 µs per node, most of it torch creating the nodes' Python objects on first
    access; it runs once per micro-batch, so it is kept free of per-node calls and allocations
    (parallel stacks, the kind cache read inline)."""
    order: list[Node] = []
    on_path: set[Node] = set()
    path: list[Node] = []
    leaves: list[Node] = []
    reentrant = False
    seen: set[Node] = set()
    kinds = _kinds
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        nodes, children, flags = [root], [iter(root.next_functions)], [False]
        while nodes:
            for child, _ in children[-1]:
                if child is None:
                    continue
                if child in seen:
                    if child in on_path:
                        flags[-1] = True
                    continue
                seen.add(child)
                nodes.append(child)
                children.append(iter(child.next_functions))
                flags.append(False)
                break
            else:
                node = nodes.pop()
                children.pop()
                order.append(node)
                kind = kinds.get(type(node))
                if kind is None:
                    kind = _kind(node)
                if kind == _Kind.REENTRANT:  # on the input path or not
                    reentrant = True
                if flags.pop() or node in input_nodes:
                    on_path.add(node)
                    path.append(node)
                    if flags:
                        flags[-1] = True
                elif kind == _Kind.LEAF:
                    leaves.append(node)
    return _Graph(order, on_path, path, leaves, reentrant)


def _owners(graph: _Graph, roots: Sequence[Node]) -> dict[Node, object]:
    """The owner of every node off the input path: the one input-path node (or ``_ROOT``, the
    stage output) it hangs off without passing the input path, or ``_MANY``.

    Parents come before children in reverse post-order, so one sweep pushes each node's owner down
    to its children off the path; a child reached from two owners becomes ``_MANY``."""
    on_path = graph.on_path
    owner_of: dict[Node, object] = {root: _ROOT for root in roots if root not in on_path}
    for node in reversed(graph.order):
        source = node if node in on_path else owner_of[node]
        for child, _ in node.next_functions:
            if child is None or child in on_path:
                continue
            current = owner_of.get(child)
            if current is None:
                owner_of[child] = source
            elif current is not source:
                owner_of[child] = _MANY
    return owner_of


def backward_input(
    outputs: Sequence[torch.Tensor] | Sequence[GradientEdge],
    grad_outputs: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    defer_weights: bool = True,
) -> WeightGradients:
    """Run the I pass: the gradients of ``inputs`` (leaf tensors: a stage's received input) land
    in their ``.grad``.

    ``outputs`` with ``grad_outputs`` (``None``: a scalar loss) start the backward, as in
    :func:`torch.autograd.backward`. Returns the W pass to run later; between the two, the graph
    is kept alive by ``outputs``. Inputs must be leaves: autograd's ``backward`` runs the node that
    produced an intermediate tensor named in ``inputs``, so a graph cannot be cut there.
    ``defer_weights=False`` computes every weight's gradient now (for a graph whose weights may
    also get gradients from another graph's W pass, which must not accumulate twice there).
    """
    if any(x.grad_fn is not None for x in inputs):
        raise ValueError(
            "backward_input: every input must be a leaf tensor (detach it and set requires_grad)."
        )
    tensors: list[Any] = list(outputs)  # tensors, or gradient edges (a stage's stashed skips)
    grads: list[torch.Tensor | None] = (
        list(grad_outputs) if grad_outputs is not None else [None] * len(tensors)
    )
    if not defer_weights:
        # Everything now: one ordinary backward accumulates the inputs' and every weight's
        # gradient, which is what inputs= naming all of them would do, without the analysis.
        with keeping_graph():
            torch.autograd.backward(tensors, grads, retain_graph=True)
        return WeightGradients()
    if not inputs:
        # No input wants a gradient (the first stage): nothing is on the input path, so the whole
        # backward is the W pass, one ordinary backward; walking the graph to learn that would
        # cost more than the pass itself on small stages (issue 31).
        return WeightGradients([_WeightPass(list[torch.Tensor | GradientEdge](tensors), grads, weights=None)])
    roots = [t.node if isinstance(t, GradientEdge) else get_gradient_edge(t).node for t in tensors]
    graph = _walk(roots, {get_gradient_edge(x).node for x in inputs})
    if graph.reentrant:
        torch.autograd.backward(tensors, grads)  # refuses inputs=: everything now, nothing in W
        return WeightGradients()
    owner_of = _owners(graph, roots)

    eager: list[torch.Tensor] = []
    deferred: dict[object, list[torch.Tensor]] = {}
    for leaf in graph.leaves:
        owner = owner_of[leaf]
        weight = leaf.variable  # type: ignore[attr-defined]
        if owner is _MANY or (owner is not _ROOT and _kind(owner) == _Kind.CUSTOM):  # type: ignore[arg-type]
            eager.append(weight)
        else:
            deferred.setdefault(owner, []).append(weight)

    work = WeightGradients()
    for node in graph.path:  # post-order: the same on every rank
        weights = deferred.get(node)
        if weights is not None:
            edges = [
                k
                for k, (child, _) in enumerate(node.next_functions)
                if child is not None and owner_of.get(child) is node
            ]
            work.owners.append(_Owner(node, edges, weights))
    handles = [owner.node.register_prehook(owner.record) for owner in work.owners]
    try:
        with keeping_graph():  # a compiled layer's backward runs here, once, keeping the graph
            torch.autograd.backward(tensors, grads, inputs=[*inputs, *eager], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()

    root_weights = deferred.get(_ROOT)
    if root_weights is not None:
        starts = [
            (t, g) for t, g, node in zip(tensors, grads, roots, strict=True) if node not in graph.on_path
        ]
        work.passes.append(_WeightPass([t for t, _ in starts], [g for _, g in starts], root_weights))
    return work
