"""Context parallelism's pieces (``lightning_pipe.context``): the load-balanced cut of a sequence,
and ring attention on real processes (gloo) against full attention on one process.

One launch of two ranks checks, in float64 within 1e-9 and float32 within 1e-5: ring attention's
output and its query/key/value gradients (causal and not, grouped-query, right- and left-padded,
packed documents) equal to one process's full attention cut the same way; a small hand-written
GPT whose attention call is the ``ring_attention`` marker, trained three SGD steps at C=2 (each
rank's blocks seeing half the tokens, gradients summed over the group), equal to one device in
loss and weights; and Hugging Face families with ring attention through transformers' attention
interface (llama padded and packed, mistral's sliding window, qwen3, gemma3_text) equal to the
model's own attention on one device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_pipe.context import (
    ContextParallelError,
    ContextShard,
    chunk_indices,
    context_shard,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from tests import hf_families
from tests.distributed import run_distributed


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    key_mask: torch.Tensor | None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full attention on one process, written independently of the ring: repeated key/value
    heads, one softmax over every key; a row with no key to attend to is 0."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    tokens = q.shape[2]
    allowed = torch.ones(q.shape[0], 1, tokens, tokens, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return probs @ v


CASES = [
    # (name, heads, kv_heads, causal, padding)
    ("causal", 4, 4, True, None),
    ("full", 4, 4, False, None),
    ("gqa", 4, 2, True, None),
    ("padded-right", 4, 2, True, "right"),
    ("padded-left", 4, 1, True, "left"),
    ("packed", 4, 2, True, "packed"),  # documents of 3, 7 and 6 tokens, across the chunks
]


def _inputs(heads: int, kv_heads: int, padding: str | None, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    batch, tokens, dim = 2, 16, 8
    q = torch.randn(batch, heads, tokens, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, tokens, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, tokens, dim, generator=g, dtype=dtype)
    grad = torch.randn(batch, heads, tokens, dim, generator=g, dtype=dtype)
    mask = None
    if padding == "packed":
        return q, k, v, grad, torch.tensor([0] * 3 + [1] * 7 + [2] * 6).expand(batch, -1)
    if padding is not None:
        mask = torch.ones(batch, tokens, dtype=torch.bool)
        cut = [tokens, tokens - 5]  # the second sample padded by 5
        for row, length in enumerate(cut):
            if padding == "right":
                mask[row, length:] = False
            else:
                mask[row, : tokens - length] = False
    return q, k, v, grad, mask


def _attention_errors(
    group: dist.ProcessGroup | None, rank: int, size: int, dtype: torch.dtype
) -> dict[str, float]:
    """Max difference of output and gradients, this rank's part against the full reference's."""
    errors = {}
    for seed, (name, heads, kv_heads, causal, padding) in enumerate(CASES):
        q, k, v, grad, mask = _inputs(heads, kv_heads, padding, dtype, seed)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        documents = mask if padding == "packed" else None
        mask = None if padding == "packed" else mask
        expected = reference_attention(*full, causal, mask, documents)
        expected.backward(grad)
        local = [shard_sequence(t, 2, rank, size).requires_grad_() for t in (q, k, v)]
        positions = chunk_indices(q.shape[2], rank, size)
        local_mask = None if mask is None else shard_sequence(mask, 1, rank, size)
        local_documents = None if documents is None else shard_sequence(documents, 1, rank, size)
        shard = ContextShard(group, positions, local_mask, local_documents)
        with context_shard(shard):
            out = ring_attention(*local, causal=causal)
        out.backward(shard_sequence(grad, 2, rank, size))
        pairs = [(out, expected)] + [(t.grad, f.grad) for t, f in zip(local, full, strict=True)]
        errors[name] = max(
            float((mine.detach() - shard_sequence(theirs.detach(), 2, rank, size)).abs().max())
            for mine, theirs in pairs
        )
    return errors


VOCAB, DIM, HEADS, KV_HEADS, SEQ = 16, 16, 4, 2, 16


class _Attention(nn.Module):
    """Grouped-query attention whose attention call is the ``ring_attention`` marker: the only
    line a hand-written model changes for context parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * (DIM // HEADS))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        out = ring_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, DIM))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[1])
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(
    group: dist.ProcessGroup | None, rank: int, size: int, dtype: torch.dtype
) -> tuple[list[float], Any]:
    """Three SGD steps of ``_GPT`` on padded batches, the sequence split over ``size`` ranks;
    labels shifted before the split, the loss a mean over the whole batch's real tokens."""
    torch.manual_seed(0)
    model = _GPT().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        mask = torch.ones(2, SEQ, dtype=torch.bool)
        mask[1, SEQ - 6 :] = False  # right padding
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1).masked_fill(~mask, -100)
        count = int((labels != -100).sum())  # the whole batch's, before the split
        positions = chunk_indices(SEQ, rank, size)
        local_ids, local_labels = shard_sequence(ids, 1, rank, size), shard_sequence(labels, 1, rank, size)
        with context_shard(ContextShard(group, positions, shard_sequence(mask, 1, rank, size))):
            logits = model(local_ids, positions)
            loss = F.cross_entropy(
                logits.flatten(0, 1), local_labels.flatten(), ignore_index=-100, reduction="sum"
            )
            loss = loss / count
            optimizer.zero_grad()
            loss.backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)  # type: ignore[arg-type]
        losses.append(float(loss.detach() if group is None else _summed(loss, group)))
        optimizer.step()
    seen = sorted({n for block in model.blocks for n in block.seen})
    return losses, ({k: v.detach().clone() for k, v in model.state_dict().items()}, seen)


def _summed(loss: torch.Tensor, group: dist.ProcessGroup) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total)


def cut_positions(inputs: dict[str, torch.Tensor], rank: int, size: int) -> torch.Tensor:
    """A packed batch's own position ids (restarting per document: the rotary tables'), this rank's."""
    return shard_sequence(inputs["position_ids"], 1, rank, size)


def _train_hf(
    family: str, kind: str, group: dist.ProcessGroup | None, rank: int, size: int
) -> dict[str, Any]:
    """Three SGD steps of a tiny Hugging Face family on right-padded or packed batches (10 tokens
    padded to 12, a multiple of 2C), with the model's own attention on one device (``group`` None) or ring
    attention on this rank's chunks: global position ids, labels shifted before the split, the
    loss a mean over the whole batch's predicted tokens."""
    from lightning_pipe.huggingface.outputs import IGNORE_INDEX
    from lightning_pipe.huggingface.ring_attention import use_ring_attention

    model = hf_families.build(
        family, torch.float64 if hf_families.FAMILIES[family].float64 else torch.float32
    )
    if group is not None:
        use_ring_attention(model)
    seen: list[int] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(args[0].shape[1]), with_kwargs=True
    )
    # float32 families at lr 0.1, as tests/test_huggingface_families.py (its LR_FLOAT32 says why)
    lr = 0.5 if hf_families.FAMILIES[family].float64 else 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in hf_families.batches(kind, 3, 3):
        # 10 tokens padded to 12: masked padding, or (packed) a last document of 2 tokens.
        rows = batch["input_ids"].shape[0]
        ids = F.pad(batch["input_ids"], (0, 2))
        labels = F.pad(batch["labels"], (0, 2), value=IGNORE_INDEX)
        if kind == "packed":
            inputs = {"position_ids": torch.cat([batch["position_ids"], torch.arange(2).expand(rows, 2)], 1)}
            mask, documents = None, (inputs["position_ids"] == 0).cumsum(1)
        else:
            inputs = {"attention_mask": F.pad(batch["attention_mask"], (0, 2))}
            mask, documents = inputs["attention_mask"].bool(), None
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        count = int((shifted != IGNORE_INDEX).sum())
        positions = chunk_indices(ids.shape[1], rank, size)
        cut = [
            None if t is None else shard_sequence(t, 1, rank, size) for t in (ids, shifted, mask, documents)
        ]
        optimizer.zero_grad()
        with context_shard(ContextShard(group, positions, cut[2], cut[3])):
            if group is None:
                logits = model(input_ids=ids, **inputs, use_cache=False).logits
            else:
                rotary = positions.expand(rows, -1) if kind == "padded" else cut_positions(inputs, rank, size)
                logits = model(input_ids=cut[0], position_ids=rotary, use_cache=False).logits
            target = shifted if group is None else cut[1]
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                )
                / count
            )
            loss.backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)  # type: ignore[arg-type]
        losses.append(float(loss.detach()) if group is None else _summed(loss, group))
        optimizer.step()
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "seen": sorted(set(seen)),
    }


HF_CASES = (
    ("llama", "padded"),
    ("llama", "packed"),
    ("mistral", "padded"),
    ("qwen3", "padded"),
    ("gemma3_text", "padded"),
)


def _ranks_check() -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    result: dict[str, Any] = {
        "float64": _attention_errors(group, rank, size, torch.float64),
        "float32": _attention_errors(group, rank, size, torch.float32),
    }
    for dtype, name in ((torch.float64, "gpt64"), (torch.float32, "gpt32")):
        losses, (state, seen) = _train(group, rank, size, dtype)
        ref_losses, (ref_state, ref_seen) = _train(None, 0, 1, dtype)
        result[name] = {
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "weights": max(float((state[k] - ref_state[k]).abs().max()) for k in state),
            "moved": max(float((ref_state[k] - _GPT().to(dtype).state_dict()[k]).abs().max()) for k in state),
            "seen": seen,
            "ref_seen": ref_seen,
        }
    # grouped-query attention, padded and packed; a sliding window (5 of 12 tokens); query/key
    # norms; sliding and full layers with a rotary table each (float32)
    for family, kind in HF_CASES:
        mine, reference = _train_hf(family, kind, group, rank, size), _train_hf(family, kind, None, 0, 1)
        result[f"{family}-{kind}"] = {
            "loss": max(abs(a - b) for a, b in zip(mine["losses"], reference["losses"], strict=True)),
            "weights": max(
                float((mine["state"][k] - reference["state"][k]).abs().max()) for k in mine["state"]
            ),
            "seen": mine["seen"],
            "ref_seen": reference["seen"],
        }
    return result


@pytest.mark.distributed
def test_ring_attention_and_a_hand_written_gpt_at_c2_equal_one_device() -> None:
    for result in run_distributed(_ranks_check, 2):
        for case, error in result["float64"].items():
            assert error < 1e-9, (case, error)
        for case, error in result["float32"].items():
            assert error < 1e-5, (case, error)
        for name, tolerance in (("gpt64", 1e-9), ("gpt32", 1e-5)):
            gpt = result[name]
            assert gpt["loss"] < tolerance and gpt["weights"] < tolerance, (name, gpt)
            assert gpt["moved"] > 1e-3, gpt  # the steps changed the weights
            assert gpt["seen"] == [SEQ // 2] and gpt["ref_seen"] == [SEQ], gpt  # 1/C of the tokens
        for family, kind in HF_CASES:
            hf = result[f"{family}-{kind}"]
            tolerance = 1e-9 if hf_families.FAMILIES[family].float64 else 1e-5
            assert hf["loss"] < tolerance and hf["weights"] < tolerance, (family, kind, hf)
            assert hf["seen"] == [6] and hf["ref_seen"] == [12], (family, hf)


def test_ring_attention_on_one_process_is_full_attention() -> None:
    errors = _attention_errors(None, 0, 1, torch.float64)
    assert max(errors.values()) < 1e-12, errors


def test_the_load_balanced_cut() -> None:
    assert chunk_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(2, 12)
    parts = [shard_sequence(x, 1, r, 3) for r in range(3)]
    assert parts[2].tolist()[0] == [4, 5, 6, 7]
    assert torch.equal(unshard_sequence(parts, 1), x)


def test_a_length_not_divisible_by_2c_is_refused_with_the_fix() -> None:
    with pytest.raises(ContextParallelError, match=r"sequence length is 10, not a multiple of 4.*here 12"):
        shard_sequence(torch.zeros(2, 10), 1, 0, 2)


def test_hugging_face_families_ring_attention_cannot_compute_are_refused_by_name() -> None:
    from lightning_pipe.huggingface.ring_attention import use_ring_attention
    from tests import hf_families

    batch = hf_families.padded_batch(2, seed=1)
    inputs = {"input_ids": batch["input_ids"][:, :8], "position_ids": chunk_indices(8, 0, 1)[None]}
    gemma2 = hf_families.build("gemma2")
    use_ring_attention(gemma2)
    with context_shard(ContextShard(None, chunk_indices(8, 0, 1))):
        with pytest.raises(ContextParallelError, match="gemma2 soft-caps its attention logits"):
            gemma2(**inputs)
    llama = hf_families.build("llama")
    use_ring_attention(llama)
    # Outside a shard transformers builds no mask for this implementation: refused, not unmasked.
    refusal = r"runs only inside a context shard.*set_attn_implementation"
    with pytest.raises(ContextParallelError, match=refusal):
        llama(**inputs)
