"""Dropless token dispatch over an expert group: each token goes to the ranks holding its experts.

A mixture-of-experts layer's router gives every token ``top_k`` experts (``indices``, shape
``[tokens, top_k]``) and their weights. Under expert parallelism the ``E`` ranks of an expert group
each hold a contiguous block of ``num_experts / E`` experts (:mod:`.shard`), so
:func:`dispatch_combine`:

1. flattens the ``tokens x top_k`` assignments and sorts them by expert (a stable sort: by
   destination rank, then by local expert, tokens in order);
2. exchanges the counts first (``all_to_all_single`` of ``[E, local experts]`` integers, which
   reach the host: the split sizes of the exchange below; one host synchronisation per
   mixture-of-experts layer and forward (again in a recomputed forward; the backward reuses
   the forward's split sizes), inherent to a dropless dispatch);
3. sends each assignment's hidden state to its expert's rank (``all_to_all_single`` with
   variable splits, an autograd function whose backward is the mirror exchange);
4. runs the local experts on what arrived (the caller's ``local_experts``, with indices into the
   local block);
5. sends the results back (the mirror exchange) and sums them per token, each weighted by its
   router weight, in expert order (as the families' own loops add them).

No token is dropped and no capacity applies, so the result is the experts' on one device; the
router's weights are applied on the token's own rank, so the router's gradient is computed there.
gloo (CPU) and NCCL both implement ``all_to_all_single`` with uneven splits. Every rank of the
group must call this for the same layer at the same point (the data-parallel ranks of one expert
group run the same schedule); a rank that receives no assignment still takes part in both
exchanges, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(rows [R, hidden], local expert index [R]) -> each row through its expert [R, hidden]``
(unweighted)."""


@dataclass(frozen=True)
class ExpertGroup:
    """Where this rank's experts sit in its expert group."""

    group: dist.ProcessGroup
    size: int
    """Ranks in the group (``E``)."""
    rank: int
    """This rank's index in the group (``ep_rank``): it holds experts
    ``[rank x local, (rank + 1) x local)``."""
    num_experts: int
    """Experts of the whole layer."""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.local_experts


@dataclass
class DispatchStats:
    """What the exchanges of one :func:`dispatch_combine` moved (for the benchmark)."""

    sent_rows: int = 0
    """Rows this rank sent to other ranks (assignments to experts it does not hold)."""
    received_rows: int = 0
    """Rows it computed (its own included)."""


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` go to the group's ranks, ``receive`` rows come from each;
    the backward is the mirror exchange."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(
    x: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(receive), list(send), group=group)
    return out


def dispatch_combine(
    hidden: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertGroup,
    local_experts: LocalExperts,
    keep_in_graph: Sequence[torch.Tensor] = (),
    stats: DispatchStats | None = None,
) -> torch.Tensor:
    """The mixture of ``hidden`` (``[tokens, hidden]``) through the experts ``indices``
    (``[tokens, top_k]``, global expert numbers) weighted by ``weights`` (``[tokens, top_k]``),
    computed by the ranks holding those experts; see the module docstring. ``keep_in_graph``: the
    local experts' parameters, joined to the output with a zero weight when no row arrives (their
    gradient is then zero, as on one device, and the exchanges' backward still runs on this rank).
    """
    size, local = experts.size, experts.local_experts
    top_k = indices.shape[1]
    flat = indices.reshape(-1)
    # Stable: equal experts keep the token order, so each token's contributions are added in
    # the order of its experts, as the families' loops over experts add them.
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=experts.num_experts).view(size, local)
    arriving = torch.empty_like(per_expert)
    dist.all_to_all_single(arriving, per_expert, group=experts.group)
    # The split sizes must be on the host (one read for both directions' counts).
    both = torch.stack([per_expert.sum(1), arriving.sum(1)]).tolist()
    send, receive = both[0], both[1]
    arriving_per_expert = arriving.reshape(-1)
    token_of = torch.div(order, top_k, rounding_mode="floor")
    rows = _AllToAll.apply(hidden[token_of], send, receive, experts.group)
    # Arrived rows are grouped by source rank, each sorted by local expert.
    local_index = torch.arange(local, device=hidden.device).repeat(size)
    local_index = torch.repeat_interleave(local_index, arriving_per_expert, output_size=sum(receive))
    if sum(receive) > 0:
        computed = local_experts(rows, local_index)
    else:  # nothing to compute: still part of the graph (the exchanges' backward must run here)
        computed = rows
    if keep_in_graph and sum(receive) == 0:
        zero = sum(p.reshape(-1)[:1].sum() for p in keep_in_graph) * 0
        computed = computed + zero
    back = _AllToAll.apply(computed, receive, send, experts.group)
    if stats is not None:
        stats.sent_rows += sum(send) - send[experts.rank]
        stats.received_rows += sum(receive)
    weighted = back * weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(hidden)
    out.index_add_(0, token_of, weighted.to(hidden.dtype))
    return out
