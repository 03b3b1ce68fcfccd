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
  the I pass, the gradient that flowed into it. The W pass re-runs each owner from that recorded
  gradient with only its own weights as ``inputs``: the engine then runs the owner's weight
  outputs and the weight-only nodes below it, and nothing of the input path again. Weights hanging
  off the output directly (a stage without a grad-requiring input: the first stage) are owned by
  the output itself and get the ordinary backward in W.
* A weight reached from *two* owners (a weight used twice in a stage, or a tied copy in it) would
  get its second owner's part twice if each owner's W pass were allowed to walk to it (the double
  counting of torch's zero-bubble stages, pytorch #181365). Such weights get their whole gradient
  in the I pass instead, with the input: slower, never wrong. So do weights whose owner is a
  custom ``autograd.Function`` (its Python backward computes every gradient whatever is needed,
  so running it again in W would repeat its work and its side effects, collectives included).
* A graph holding torch's *reentrant* checkpoint cannot be run with ``inputs=`` at all: such a
  stage gets its whole ordinary backward in I, and W has nothing left to do.
* W re-runs an owner from the gradient recorded *after* the tensor hooks on its output ran; a
  pre-hook on the owner hands the recorded gradient back during W, so those hooks do not apply
  twice.

Gradients land in ``.grad`` through ``backward`` (not ``autograd.grad``), so post-accumulate-grad
hooks (the data-parallel reducer's) fire as usual. The I pass keeps the graph
(``retain_graph=True``) for W; the graph, with everything it saved, is freed when W is done and
the executor drops the micro-batch's stash, which is why a micro-batch counts as in flight from
its forward to its W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils.checkpoint import CheckpointFunction

_ROOT = object()
"""The owner of weights reached from the stage output without passing the input path."""


@dataclass
class _WeightPass:
    outputs: list[torch.Tensor | GradientEdge]
    grads: list[torch.Tensor | None]
    weights: list[torch.Tensor] | None
    """The weights this pass computes (``None``: everything the outputs lead to)."""
    owner: Node | None = None
    """The input-path node re-run from ``grads`` (``None``: the stage output itself)."""
    recorded: tuple[torch.Tensor | None, ...] = ()


@dataclass
class WeightGradients:
    """What the I pass leaves for the W pass: one backward per owner of deferred weights, in the
    graph's order (the same on every tensor-parallel rank, whose W passes may hold collectives)."""

    passes: list[_WeightPass] = field(default_factory=list)

    def run(self) -> None:
        """Accumulate the deferred weights' gradients into their ``.grad``."""
        for p in self.passes:
            handle = None
            if p.owner is not None:
                # Tensor hooks on the owner's output already shaped the recorded gradient; node
                # pre-hooks run after them, so this one discards their second application.
                recorded = p.recorded
                handle = p.owner.register_prehook(lambda _grads, recorded=recorded: recorded)
            try:
                torch.autograd.backward(p.outputs, p.grads, inputs=p.weights, retain_graph=True)  # type: ignore[arg-type]
            finally:
                if handle is not None:
                    handle.remove()
        self.passes.clear()


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``roots``, each after all of its children (the graph is a DAG)."""
    order: list[Node] = []
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(node, False) for node in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = kids = _children(node)
        stack.append((node, True))
        stack.extend((kid, False) for kid in kids if kid not in children)
    return order, children


def _is_leaf(node: Node) -> bool:
    """An ``AccumulateGrad`` node: where a leaf tensor's gradient is accumulated."""
    return hasattr(node, "variable")


def _is_custom(node: object) -> bool:
    """The node of a custom ``torch.autograd.Function`` (its backward runs in full)."""
    return isinstance(node, BackwardCFunction)


def _is_reentrant_checkpoint(node: object) -> bool:
    return getattr(node, "_forward_cls", None) is CheckpointFunction


def backward_input(
    outputs: Sequence[torch.Tensor],
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
    tensors = list(outputs)
    grads: list[torch.Tensor | None] = (
        list(grad_outputs) if grad_outputs is not None else [None] * len(tensors)
    )
    if not inputs and defer_weights:
        # No input wants a gradient (the first stage): nothing is on the input path, so the whole
        # backward is the W pass, one ordinary backward; walking the graph to learn that would
        # cost more than the pass itself on small stages (issue 31).
        return WeightGradients([_WeightPass(list[torch.Tensor | GradientEdge](tensors), grads, weights=None)])
    roots = [get_gradient_edge(t).node for t in tensors]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    order, children = _post_order(roots)
    if any(_is_reentrant_checkpoint(node) for node in order):
        torch.autograd.backward(tensors, grads)  # refuses inputs=: everything now, nothing in W
        return WeightGradients()
    on_input_path: set[Node] = set()
    path_order: list[Node] = []  # the input path in post-order: deterministic, unlike the set
    for node in order:  # children first
        if node in input_nodes or any(kid in on_input_path for kid in children[node]):
            on_input_path.add(node)
            path_order.append(node)

    # Owners of every weight: input-path nodes (or the output) it hangs off without the input path.
    owners: dict[Node, set[object]] = {}

    def hang_off(starts: Sequence[Node], owner: object) -> None:
        stack = [kid for kid in starts if kid not in on_input_path]
        visited: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            if _is_leaf(node):
                owners.setdefault(node, set()).add(owner)
            else:
                stack.extend(kid for kid in children[node] if kid not in on_input_path)

    for node in path_order:
        hang_off(children[node], node)
    hang_off(roots, _ROOT)

    eager: list[torch.Tensor] = []
    deferred: dict[object, list[torch.Tensor]] = {}
    for leaf, who in owners.items():
        weight = leaf.variable  # type: ignore[attr-defined]
        if not defer_weights or len(who) > 1 or any(_is_custom(owner) for owner in who):
            eager.append(weight)
        else:
            deferred.setdefault(next(iter(who)), []).append(weight)

    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for owner in deferred:
        if owner is not _ROOT:

            def record(grads_in: tuple[torch.Tensor | None, ...], node: Node = owner) -> None:  # type: ignore[assignment]
                recorded[node] = grads_in

            handles.append(owner.register_prehook(record))  # type: ignore[attr-defined]
    try:
        targets = [x for x in inputs] + eager
        if targets:
            torch.autograd.backward(tensors, grads, inputs=targets, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()

    work = WeightGradients()
    for owner, weights in deferred.items():
        if owner is _ROOT:
            starts = [
                (t, g) for t, g, node in zip(tensors, grads, roots, strict=True) if node not in on_input_path
            ]
            work.passes.append(_WeightPass([t for t, _ in starts], [g for _, g in starts], weights))
            continue
        grads_in = recorded.get(owner)  # type: ignore[call-overload]
        if grads_in is None:  # no gradient reached it: its weights get none, as in one backward
            continue
        slots = [(k, g) for k, g in enumerate(grads_in) if g is not None]
        if slots:
            edges: list[torch.Tensor | GradientEdge] = [GradientEdge(owner, k) for k, _ in slots]  # type: ignore[arg-type]
            work.passes.append(_WeightPass(edges, [g for _, g in slots], weights, owner, grads_in))  # type: ignore[arg-type]
    return work
