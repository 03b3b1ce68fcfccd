"""Ring attention: exact (causal) attention over a sequence split across a context group.

Each rank holds its queries, keys and values for its own tokens (see ``chunks``). The key/value
blocks travel around the group (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``, with
the global positions and padding mask of the block's tokens), and each rank merges the partial
results of its queries against every block with the online softmax: the running output is
rescaled by ``exp(lse_old - lse_new)`` as each block's log-sum-exp is added. The exchange of the
next block is posted before the current block is computed, so the two overlap where the transport
allows (NCCL; gloo on CPU sends as it can).

The backward is exact and recomputes each block's probabilities from the saved log-sum-exp (no
``[queries, keys]`` tensor is kept between forward and backward): the key/value blocks go around
the ring again, each travelling with the accumulated gradients of its keys and values, which every
rank adds its queries' share to; one last hop brings those gradients home.

Every block pair is computed with plain matmul and softmax in float32 (float64 for float64
inputs), so a split sequence matches one device's attention to rounding. Grouped-query attention
(fewer key/value heads than query heads) sends the key/value heads once, not repeated. A query
row with no key it may attend to (all masked) gets a zero output and zero gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.context.scope import active_shard, note_ring_call


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys and values.

    The marker of a hand-written model's attention call: without an active context shard (and
    no ``group``) it is plain (causal) attention over the tokens given; under one (see
    :func:`lightning_pipe.context.context_shard`), the tokens given are this rank's part and the
    other parts' keys and values come around the ring.

    Args:
        query: ``[batch, heads, tokens, head_dim]``.
        key: ``[batch, kv_heads, tokens, head_dim]``; ``heads`` a multiple of ``kv_heads``.
        value: like ``key``.
        causal: mask each query's later positions.
        window: a sliding window: a query at position ``i`` attends only to keys at positions
            ``i - window < j`` (Hugging Face's ``sliding_window``); ``None`` for none.
        scale: the scores' factor (default ``head_dim ** -0.5``).
        key_mask: ``[batch, tokens]``, ``True`` for a real token (default: the shard's, or none).
        documents: ``[batch, tokens]``, the document each token belongs to in packed sequences:
            a query attends only to keys of its own document (default: the shard's, or one
            document per row).
        positions: ``[tokens]``, the global positions of the tokens (default: the shard's, or
            ``0..tokens-1``).
        group: the context group (default: the shard's, or none).

    Returns:
        ``[batch, heads, tokens, head_dim]`` in ``query``'s dtype.
    """
    shard = active_shard()
    if shard is not None:
        note_ring_call()
        group = shard.group if group is None else group
        positions = shard.positions if positions is None else positions
        key_mask = shard.key_mask if key_mask is None else key_mask
        documents = shard.documents if documents is None else documents
    batch, heads, tokens, head_dim = query.shape
    if (
        key.shape != value.shape
        or key.shape[0] != batch
        or key.shape[2] != tokens
        or key.shape[3] != head_dim
    ):
        raise ValueError(
            f"ring_attention takes query [batch, heads, tokens, head_dim] and key/value "
            f"[batch, kv_heads, tokens, head_dim] with the same batch, tokens and head_dim; got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        )
    if heads % key.shape[1]:
        raise ValueError(
            f"ring_attention: {heads} query heads are not a multiple of {key.shape[1]} key/value heads."
        )
    if positions is None:
        positions = torch.arange(tokens, device=query.device)
    if positions.shape != (tokens,):
        raise ValueError(
            f"ring_attention: positions must be [{tokens}] (one per token), got {tuple(positions.shape)}."
        )
    if key_mask is not None and key_mask.shape != (batch, tokens):
        raise ValueError(
            f"ring_attention: key_mask must be [{batch}, {tokens}], got {tuple(key_mask.shape)}."
        )
    if documents is not None and documents.shape != (batch, tokens):
        raise ValueError(
            f"ring_attention: documents must be [{batch}, {tokens}], got {tuple(documents.shape)}."
        )
    # What travels with a key/value block: its tokens' positions, padding mask and documents.
    meta = torch.zeros(1 + 2 * batch, tokens, dtype=torch.int64, device=query.device)
    meta[0] = positions.to(query.device, torch.int64)
    meta[1 : 1 + batch] = 1 if key_mask is None else key_mask.to(query.device, torch.int64)
    if documents is not None:
        meta[1 + batch :] = documents.to(query.device, torch.int64)
    factor = head_dim**-0.5 if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(query, key, value, meta, causal, window, factor, group)
    return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Ring:
    """This rank's place in the context group and the two-sided exchange with its neighbours."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if group is not None and self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Post sending ``tensors`` to the next rank and receiving the previous rank's; returns
        the buffers they arrive in and the requests to wait on."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    q_meta: torch.Tensor,
    k_meta: torch.Tensor,
    causal: bool,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Masked scores ``[batch, heads, q_tokens, k_tokens]`` of ``q`` against the block ``k`` (its
    key/value heads already repeated for grouped-query attention)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    batch = q.shape[0]
    allowed = k_meta[1 : 1 + batch].bool()[:, None, None, :]
    allowed = allowed & (q_meta[1 + batch :][:, None, :, None] == k_meta[1 + batch :][:, None, None, :])
    if causal:
        allowed = allowed & (k_meta[0][None, :] <= q_meta[0][:, None])[None, None]
    if window is not None:
        allowed = allowed & (q_meta[0][:, None] - k_meta[0][None, :] < window)[None, None]
    return scores.masked_fill(~allowed, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that attend to nothing (``-inf``) set to 0, so that ``exp(s - lse)``
    is 0 there rather than NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: torch.Tensor,
        causal: bool,
        window: int | None,
        scale: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        dtype = _compute_dtype(q.dtype)
        repeat = q.shape[1] // k.shape[1]
        qc = q.to(dtype)
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        # Blocks travel in the inputs' dtype (half the bytes of bfloat16's float32 compute).
        block = [torch.stack([k, v]), meta]
        for step in range(ring.size):
            pending = ring.start(block) if step < ring.size - 1 else None
            kv, k_meta = block[0].to(dtype), block[1]
            scores = _scores(qc, kv[0].repeat_interleave(repeat, 1), meta, k_meta, causal, window, scale)
            new_lse = torch.logaddexp(lse, torch.logsumexp(scores, -1))
            finite = _finite(new_lse)[..., None]
            out = out * torch.exp(lse[..., None] - finite) + torch.exp(scores - finite) @ kv[
                1
            ].repeat_interleave(repeat, 1)
            lse = new_lse
            if pending is not None:
                block, requests = pending
                for request in requests:
                    request.wait()
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.causal, ctx.window, ctx.scale, ctx.group = causal, window, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, meta, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        dtype = out.dtype
        repeat = q.shape[1] // k.shape[1]
        qc, do = q.to(dtype), grad_out.to(dtype)
        finite = _finite(lse)[..., None]
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qc)
        kv = torch.stack([k, v])
        k_meta = meta
        dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)  # gradients travel in compute dtype
        batch, kv_heads, tokens, head_dim = k.shape
        for step in range(ring.size):
            keys, values = (kv[i].to(dtype).repeat_interleave(repeat, 1) for i in range(2))
            probs = torch.exp(_scores(qc, keys, meta, k_meta, ctx.causal, ctx.window, ctx.scale) - finite)
            dscores = probs * (do @ values.transpose(-1, -2) - delta)
            dq = dq + (dscores @ keys) * ctx.scale
            dk = (dscores.transpose(-1, -2) @ qc) * ctx.scale
            dv = probs.transpose(-1, -2) @ do
            grads = torch.stack([dk, dv]).view(2, batch, kv_heads, repeat, tokens, head_dim).sum(3)
            dkv = dkv + grads
            if ring.size == 1:
                break
            # The block moves on with its gradients so far; after the last block only the
            # gradients travel, the one hop that brings them to the rank that owns the block.
            sending = [kv, k_meta, dkv] if step < ring.size - 1 else [dkv]
            received, requests = ring.start(sending)
            for request in requests:
                request.wait()
            if step < ring.size - 1:
                kv, k_meta, dkv = received
            else:
                (dkv,) = received
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None
