"""Weight-gradient rules: an owner node's weight-side gradients, computed from what it saved.

The W pass of a split backward (:mod:`.split_backward`) holds, for every *owner* (a node of the
input path where weights leave it), the gradient that flowed into it during the I pass. Running
the owner again through autograd costs one backward call per owner, and autograd walks everything
reachable from the root of a call before running it: from an owner, the whole input path down to
the stage input. A stack of n layers pays O(n) calls of O(n) walks each (issue 31).

A rule does the owner's part in Python instead: it computes the gradients of the owner's
weight-side outputs (the edges into the weight-only subgraphs) with the formula autograd uses for
that node (torch's ``derivatives.yaml`` and ``FunctionsManual.cpp``: ``mm_mat1_backward``,
``mm_mat2_backward``, ``native_layer_norm_backward``, ...), from the same saved tensors and in the
same operand order, so the result is bitwise what autograd would produce. The W pass then starts
*one* backward call from those edges for every ruled owner at once; its walk covers only the
weight-only subgraphs (a transpose, autocast's cast, the ``AccumulateGrad`` nodes), and
``AccumulateGrad`` still runs, so post-accumulate-grad hooks (the data-parallel reducer's) fire.

A rule declines, and the owner gets its own backward call as before, when it could not be sure to
match autograd: an unknown node type (custom ``autograd.Function``s never get a rule), a gradient
on an output other than the first, complex or non-strided tensors, a saved tensor that is missing
or sits behind saved-tensor hooks (a non-reentrant checkpoint's hook recomputes its whole region
on every read; offloading hooks would copy). The one thing a rule skips that a backward call of
the owner would run: node *post*-hooks registered on the owner itself (``node.register_hook``),
which Python cannot list; the project registers none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

_functions = torch._C._functions


class _DeclineError(Exception):
    """Raised inside a rule that cannot reproduce autograd's result exactly."""


def _saved_or_none(node: Node, name: str) -> torch.Tensor | None:
    """A saved tensor of ``node`` (``None``: saved undefined), only when reading it is plain (no
    saved-tensor hooks)."""
    raw = getattr(node, "_raw_saved_" + name, None)
    if raw is None or raw.unpack_hook is not None:
        raise _DeclineError
    tensor: torch.Tensor | None = getattr(node, "_saved_" + name)
    if tensor is not None and (tensor.layout != torch.strided or tensor.is_complex()):
        raise _DeclineError
    return tensor


def _saved(node: Node, name: str) -> torch.Tensor:
    tensor = _saved_or_none(node, name)
    if tensor is None:
        raise _DeclineError
    return tensor


def _maybe_multiply(t: torch.Tensor, s: float) -> torch.Tensor:
    # FunctionsManual.cpp's maybe_multiply: a factor of exactly 1 is skipped, which keeps the bits.
    return t if s == 1 else t * s


def _column_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    return strides[0] == 1 and strides[1] == sizes[0]


def _mm_mat1(
    grad: torch.Tensor, mat2: torch.Tensor, sizes: Sequence[int], strides: Sequence[int], alpha: float
) -> torch.Tensor:
    """``mm_mat1_backward``: a column-major ``mat1`` gets its gradient column-major too."""
    if _column_major(sizes, strides):
        return _maybe_multiply(mat2.mm(grad.t()).t(), alpha)
    return _maybe_multiply(grad.mm(mat2.t()), alpha)


def _mm_mat2(
    grad: torch.Tensor, mat1: torch.Tensor, sizes: Sequence[int], strides: Sequence[int], alpha: float
) -> torch.Tensor:
    """``mm_mat2_backward``: ``Linear``'s ``weight.t()`` is column-major, so it takes the first branch."""
    if _column_major(sizes, strides):
        return _maybe_multiply(grad.t().mm(mat1).t(), alpha)
    return _maybe_multiply(mat1.t().mm(grad), alpha)


def _addmm(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    # addmm(self, mat1, mat2, beta, alpha); next edges: self (a Linear's bias), mat1, mat2.
    out = []
    for k in edges:
        if k == 0:
            out.append(_maybe_multiply(grad, node._saved_beta))  # type: ignore[attr-defined]
        elif k == 1:
            sizes, strides = node._saved_mat1_sym_sizes, node._saved_mat1_sym_strides  # type: ignore[attr-defined]
            out.append(_mm_mat1(grad, _saved(node, "mat2"), sizes, strides, node._saved_alpha))  # type: ignore[attr-defined]
        else:
            sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides  # type: ignore[attr-defined]
            out.append(_mm_mat2(grad, _saved(node, "mat1"), sizes, strides, node._saved_alpha))  # type: ignore[attr-defined]
    return out


def _mm(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    out = []
    for k in edges:
        if k == 0:
            sizes, strides = node._saved_self_sym_sizes, node._saved_self_sym_strides  # type: ignore[attr-defined]
            out.append(_mm_mat1(grad, _saved(node, "mat2"), sizes, strides, 1))
        else:
            sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides  # type: ignore[attr-defined]
            out.append(_mm_mat2(grad, _saved(node, "self"), sizes, strides, 1))
    return out


def _bmm(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    # derivatives.yaml: self: grad.bmm(mat2.transpose(1, 2).conj()),
    # mat2: self.transpose(1, 2).conj().bmm(grad)
    return [
        grad.bmm(_saved(node, "mat2").transpose(1, 2))
        if k == 0
        else _saved(node, "self").transpose(1, 2).bmm(grad)
        for k in edges
    ]


def _layer_norm(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    # One kernel call for weight and bias, with the input's gradient masked off: what the engine
    # asks of the node when only the weight side is needed.
    weight, bias = _saved_or_none(node, "weight"), _saved_or_none(node, "bias")  # LayerNorm(bias=False)
    _, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad,
        _saved(node, "input"),
        node._saved_normalized_shape,  # type: ignore[attr-defined]
        _saved(node, "result1"),
        _saved(node, "result2"),
        weight,
        bias,
        [False, 1 in edges, 2 in edges],
    )
    return [grad_weight if k == 1 else grad_bias for k in edges]


def _conv(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad,
        _saved(node, "input"),
        _saved(node, "weight"),
        node._saved_bias_sym_sizes_opt,  # type: ignore[attr-defined]
        node._saved_stride,  # type: ignore[attr-defined]
        node._saved_padding,  # type: ignore[attr-defined]
        node._saved_dilation,  # type: ignore[attr-defined]
        node._saved_transposed,  # type: ignore[attr-defined]
        node._saved_output_padding,  # type: ignore[attr-defined]
        node._saved_groups,  # type: ignore[attr-defined]
        [False, 1 in edges, 2 in edges],
    )
    return [grad_weight if k == 1 else grad_bias for k in edges]


def _add(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    # derivatives.yaml: self: grad, other: maybe_multiply(grad, alpha); broadcasting is undone by
    # the engine's sum_to (here _fit_to_edge), as for any output.
    return [grad if k == 0 else _maybe_multiply(grad, node._saved_alpha) for k in edges]  # type: ignore[attr-defined]


def _mul(node: Node, grad: torch.Tensor, edges: Sequence[int]) -> list[torch.Tensor]:
    # derivatives.yaml: self: mul_tensor_backward(grad, other), i.e. grad * other; other: grad * self.
    return [grad * _saved(node, "other") if k == 0 else grad * _saved(node, "self") for k in edges]


Rule = Callable[[Node, torch.Tensor, Sequence[int]], list[torch.Tensor]]


def _rules() -> dict[type, Rule]:
    by_name: dict[str, Rule] = {
        "AddmmBackward0": _addmm,
        "MmBackward0": _mm,
        "BmmBackward0": _bmm,
        "NativeLayerNormBackward0": _layer_norm,
        "ConvolutionBackward0": _conv,
        "AddBackward0": _add,
        "MulBackward0": _mul,
    }
    # Keyed by the node's class, not its name: a custom Function called "Addmm" has a node class
    # named "AddmmBackward" too, and must never get a rule. A torch without one of them just has
    # no rule for it.
    return {getattr(_functions, name): rule for name, rule in by_name.items() if hasattr(_functions, name)}


RULES: dict[type, Rule] = _rules()

_FITTED: dict[type, frozenset[int]] = {
    getattr(_functions, name): frozenset(edges)
    for name, edges in (("AddmmBackward0", (0,)), ("AddBackward0", (0, 1)), ("MulBackward0", (0, 1)))
    if hasattr(_functions, name)
}
"""The edges whose gradient may be broadcast (a bias, an added or multiplied weight) or of another
dtype (type promotion): the engine fits a node's outputs to its edges (``validate_outputs``), so
these are fitted too; the others have their edge's shape and dtype by construction."""


def has_rule(node: Node) -> bool:
    return type(node) in RULES


def _fit_to_edge(grad: torch.Tensor, child: Node, nr: int) -> torch.Tensor:
    """What the engine's ``validate_outputs`` does to a node's output before passing it on."""
    if hasattr(child, "variable"):  # AccumulateGrad: the leaf itself says what it expects
        shape, dtype = child.variable.shape, child.variable.dtype
    else:
        meta = child._input_metadata[nr]
        shape, dtype = torch.Size(meta.shape), meta.dtype
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    return grad


def weight_side(
    node: Node, grads_in: Sequence[torch.Tensor | None], edges: Sequence[int]
) -> list[tuple[GradientEdge, torch.Tensor]] | None:
    """The gradients autograd would send down ``node``'s next ``edges`` when it runs with
    ``grads_in`` and only those edges needed, as (edge, gradient) pairs to start a backward from;
    ``None`` when ``node`` has no rule or its rule declines (see the module docstring).

    Called once per owner and micro-batch, so it is kept lean: a caller that computes many owners
    disables grad mode once around them (the rules must not record a graph, as the engine's nodes
    do not with ``create_graph=False``)."""
    rule = RULES.get(type(node))
    if rule is None or not edges or not grads_in:
        return None
    grad = grads_in[0]
    if grad is None or (len(grads_in) > 1 and any(g is not None for g in grads_in[1:])):
        return None
    if grad.layout != torch.strided or grad.is_complex():
        return None
    try:
        if torch.is_grad_enabled():
            with torch.no_grad():
                grads = rule(node, grad, edges)
        else:
            grads = rule(node, grad, edges)
    except _DeclineError:
        return None
    fitted = _FITTED.get(type(node), ())
    next_functions = node.next_functions
    pairs = []
    for k, g in zip(edges, grads, strict=True):
        child, nr = next_functions[k]
        assert child is not None, "a weight-side edge always leads somewhere"
        pairs.append((GradientEdge(child, nr), _fit_to_edge(g, child, nr) if k in fitted else g))
    return pairs
