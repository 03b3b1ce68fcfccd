"""What context parallelism (ring attention over C ranks) buys in activation memory, and costs in time.

A small GPT whose attention is ``lightning_pipe.context.ring_attention`` is trained with its
sequence split over C gloo processes (C = 1, 2, 4; C = 1 is one process, plain attention), the
gradients summed over the group as the data axis would. For each C:

* **activation bytes per rank** for a fixed sequence (``--seq``): the bytes autograd saves for
  the backward in one forward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted
  once, the parameters not counted), on rank 0, and their ratio to C = 1;
* **the longest sequence under a fixed limit**: the limit is C = 1's activation bytes at
  ``--seq`` (``--limit-mib`` to set another); sequences are doubled from ``--seq`` while rank 0's
  saved bytes stay under it (measured, not extrapolated). The ring's transient scores block
  (``[batch, heads, local tokens, local tokens]`` in float32, freed block by block) is not saved
  and not counted;
* **step time** (median of ``--steps`` after one warm-up) and its ratio to C = 1.

On this CPU machine gloo sends each block after the previous block's compute has been posted, and
C processes share two cores: step times measure the extra work and messages, not a speed-up.
On GPUs with NCCL the next block's exchange overlaps the current block's matmuls (the ring posts
it first), so a ring step costs about one block's compute when a block's compute outlasts the
transfer of one key/value block (2 x batch x kv_heads x S/C x head_dim elements).

Run: ``python benchmarks/context_parallel.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import emit_json, launch, median, print_table, warn_if_busy
from torch import nn

from lightning_pipe.context import ContextShard, chunk_indices, context_shard, ring_attention, shard_sequence

VOCAB = 256


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(ring_attention(q, k, v).transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self, width: int, heads: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(max_len, width)
        self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tokens(ids) + self.positions(positions)))


def _loss(model: _GPT, ids: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    positions = chunk_indices(ids.shape[1], rank, size)
    local_ids, local_labels = shard_sequence(ids, 1, rank, size), shard_sequence(labels, 1, rank, size)
    logits = model(local_ids, positions)
    return F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / ids.numel()


def _saved_bytes(model: _GPT, ids: torch.Tensor, group: Any, rank: int, size: int) -> int:
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved, but not activations

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with context_shard(ContextShard(group, chunk_indices(ids.shape[1], rank, size))):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, ids, group, rank, size)
        loss.backward()  # the ring's backward exchanges too: every rank runs it
    model.zero_grad()
    return sum(seen.values())


def worker(args: dict[str, Any]) -> dict[str, Any]:
    size = dist.get_world_size()
    rank, group = dist.get_rank(), (dist.group.WORLD if size > 1 else None)
    torch.manual_seed(0)
    model = _GPT(args["width"], args["heads"], args["layers"], args["max_len"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args["batch"], args["seq"]), generator=g)
    out: dict[str, Any] = {"bytes": _saved_bytes(model, ids, group, rank, size)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(args["steps"] + 1):
        start = time.perf_counter()
        with context_shard(ContextShard(group, chunk_indices(ids.shape[1], rank, size))):
            loss = _loss(model, ids, group, rank, size)
            optimizer.zero_grad()
            loss.backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)  # type: ignore[arg-type]
        optimizer.step()
        times.append(time.perf_counter() - start)
    out["step"] = median(times[1:]) if len(times) > 1 else 0.0
    longest, seq = 0, args["seq"]
    while args.get("search", True) and seq <= args["max_len"]:
        longer = torch.randint(0, VOCAB, (args["batch"], seq), generator=g)
        if _saved_bytes(model, longer, group, rank, size) > args["limit"]:
            break
        longest, seq = seq, seq * 2
    out["longest"] = longest
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--limit-mib", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "sizes", "limit_mib")}
    settings["max_len"] = args.seq * 16
    settings["limit"] = 1 << 62
    base = launch(worker, 1, {**settings, "steps": 0, "search": False}, timeout=1800)[0]
    settings["limit"] = int(args.limit_mib * 2**20) if args.limit_mib else base["bytes"]
    results = {c: launch(worker, c, settings, timeout=1800) for c in args.sizes}
    rows, payload = [], {}
    one = results[1][0] if 1 in results else None
    for c, ranks in results.items():
        step = max(r["step"] for r in ranks)
        entry = {
            "activation_bytes": ranks[0]["bytes"],
            "activation_ratio": ranks[0]["bytes"] / base["bytes"],
            "longest_seq": ranks[0]["longest"],
            "step_ms": step * 1e3,
            "step_ratio": step / max(r["step"] for r in results[1]) if one else None,
        }
        payload[c] = entry
        rows.append(
            [
                c,
                f"{entry['activation_bytes'] / 2**20:.1f}",
                f"{entry['activation_ratio']:.2f}",
                entry["longest_seq"],
                f"{entry['step_ms']:.0f}",
                "-" if entry["step_ratio"] is None else f"{entry['step_ratio']:.2f}",
            ]
        )
    if args.json:
        emit_json({"sizes": vars(args), "limit_bytes": settings["limit"], "results": payload})
    else:
        print(
            f"GPT width {args.width}, {args.layers} layers, batch {args.batch} x {args.seq} tokens; "
            f"limit {settings['limit'] / 2**20:.1f} MiB of saved activations per rank"
        )
        print_table(["C", "activations MiB/rank", "vs C=1", "longest seq", "step ms", "step vs C=1"], rows)


if __name__ == "__main__":
    main()
