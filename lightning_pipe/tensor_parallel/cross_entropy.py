"""Cross entropy on vocabulary-sharded logits, without ever gathering the ``b x s x v`` logits.

Each rank holds the logits of its slice of the vocabulary. The loss needs three numbers per token
that span the vocabulary: the maximum (for a stable softmax), the sum of exponentials and the
target's logit (non-zero on exactly one rank); each is an all-reduce of one value per token.
Backward is local: ``softmax - one_hot(target)`` restricted to this rank's slice (Megatron-LM's
vocab-parallel cross entropy).

:func:`cross_entropy` is the function to call in a ``training_step``: on logits produced by a
``"colwise_logits"`` layer it runs the parallel version, on ordinary logits it is
``F.cross_entropy``, so the same step works sharded, unsharded, and with ``strategy="auto"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_pipe.tensor_parallel.regions import gather_from_region, named

_GROUP = "_lightning_pipe_vocab_group"
_START = "_lightning_pipe_vocab_start"


def tag_vocab_parallel(logits: torch.Tensor, group: dist.ProcessGroup, vocab_start: int) -> torch.Tensor:
    """Mark ``logits`` as this rank's vocabulary slice starting at ``vocab_start``."""
    setattr(logits, _GROUP, group)
    setattr(logits, _START, vocab_start)
    return logits


def copy_vocab_parallel_tag(logits: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``logits`` computed element-wise from ``source`` (a soft-cap, a scale) keep its vocabulary
    slice's tag, which a new tensor would otherwise lose (and be taken for full logits)."""
    group = getattr(source, _GROUP, None)
    if group is not None and logits is not source:
        tag_vocab_parallel(logits, group, getattr(source, _START))
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, vocab_start: int
    ) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax sums in fp32; float64 stays float64
        doing = "computing the vocab-parallel cross entropy over the tensor-parallel group"
        peak = logits.max(dim=-1).values
        with named(doing, group):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        with named(doing, group):
            dist.all_reduce(total, group=group)
        local_vocab = logits.shape[-1]
        mine = (target >= vocab_start) & (target < vocab_start + local_vocab)
        local_target = torch.where(mine, target - vocab_start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        with named(doing, group):
            dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), mine, local_target)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, mine, local_target = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = torch.zeros_like(softmax).scatter_(
            -1, local_target.unsqueeze(-1), mine.unsqueeze(-1).to(softmax.dtype)
        )
        grad_logits -= hit
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross entropy over tokens (``target != ignore_index``) of vocab-sharded ``logits``."""
    keep = target != ignore_index
    safe = torch.where(keep, target, torch.zeros_like(target))
    losses = _VocabParallelCrossEntropy.apply(logits, safe, group, vocab_start) * keep
    return (losses.sum() / keep.sum().clamp(min=1)).to(logits.dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross entropy; vocab-parallel when ``logits`` come from a ``colwise_logits`` layer.

    ``logits`` is ``[..., vocab]`` and ``target`` ``[...]`` (any leading dims).
    """
    group = getattr(logits, _GROUP, None)
    if group is not None:
        return vocab_parallel_cross_entropy(logits, target, group, getattr(logits, _START), ignore_index)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index
    )


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from vocab-sharded ones (for metrics such as accuracy); a no-op on
    ordinary logits. This materialises ``[..., vocab]``: use it for evaluation, not for the loss."""
    group = getattr(logits, _GROUP, None)
    return logits if group is None else gather_from_region(logits, group)
