"""Expert parallelism (``expert_parallel_size``): what a rank holds and sends, and a step's time,
beside the same model with its experts replicated on every data rank.

A Hugging Face Mixtral (``--layers`` decoder layers, ``--width`` wide, ``--experts`` experts of
``--ffn`` each, top-2, sequence ``--seq``, ``--batch`` rows per rank, float32, random weights) is
trained through the engine (``ParallelRuntime``, ``CausalLMPipeline``) on two gloo processes at
dp=2, once with the experts replicated (E=1) and once split (E=2), in fresh processes each, in
alternating rounds:

* **Expert parameter bytes per rank**: the experts' stacked weights a rank holds; the goal is 1/E
  of the replicated run's, the routers (and any shared experts) whole on both.
* **All-to-all bytes per step**: the rows a rank sends to the other rank of its expert group
  (assignments to experts it does not hold), hidden states of ``--width`` float32 values, four
  times (the dispatch and the combine forward, and their mirrors in backward); the counts
  exchanged first are a few integers per layer.
* **Step time**: the median of ``--steps`` steps after two warm-up steps, best round.

gloo on a CPU moves the rows through the kernel's sockets and computes every expert's rows on the
same cores, so the step time here mostly shows the dispatch's overhead (sorting, two exchanges per
layer and direction, a host read of the counts). On GPUs with NCCL the all-to-all runs over
NVLink / InfiniBand (all_to_all_single is one NCCL call), the experts' matrix products are spread
over E devices' compute, and each device holds 1/E of the experts' weights, gradients and
optimizer state, which is what lets a model whose experts do not fit one device train at all; the
counts' host read then waits for the device (a sync per layer, as in Megatron-Core's dropless
dispatcher).

Run: ``python benchmarks/experts.py`` (table) or ``--json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import transformers
from _launch import emit_json, launch, print_table, warn_if_busy

from lightning_pipe.experts.apply import dispatch_stats
from lightning_pipe.huggingface import CausalLMPipeline
from lightning_pipe.huggingface.outputs import causal_lm_loss
from lightning_pipe.mesh import ParallelLayout, init_mesh
from lightning_pipe.runtime import Microbatch, ParallelRuntime, RuntimeOptions


def _model(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=args.width,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
    )
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def _head(output: torch.Tensor, microbatch: Microbatch) -> torch.Tensor:
    return causal_lm_loss(output, microbatch.data["labels"])


def worker(args: argparse.Namespace, e: int) -> dict[str, Any]:
    mesh = init_mesh(ParallelLayout(2, 1, 1, expert_parallel_size=e), "cpu")
    model = _model(args)
    pipeline = CausalLMPipeline(model)
    options = RuntimeOptions(
        num_microbatches=2,
        timeout=timedelta(seconds=120),
        expert_parallel_size=e,
        expert_parallel_plan=pipeline.expert_parallel_plan(e) if e > 1 else None,
    )
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=0.01))
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    router_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".gate." in n)
    g = torch.Generator().manual_seed(dist.get_rank())
    times, sent = [], []
    stats = dispatch_stats(model)
    for step in range(2 + args.steps):
        ids = torch.randint(0, 512, (args.batch, args.seq), generator=g)
        before = stats.sent_rows if stats is not None else 0
        start = time.perf_counter()
        optimizer.zero_grad()
        runtime.begin_accumulation()
        runtime.train_batch({"input_ids": ids, "labels": ids}, _head)
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
            sent.append((stats.sent_rows if stats is not None else 0) - before)
    runtime.close()
    rows = statistics.median(sent)
    return {
        "expert_bytes": expert_bytes,
        "router_bytes": router_bytes,
        "all_to_all_bytes_per_step": int(rows * args.width * 4 * 4),
        "step_s": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for e in (1, 2):
            runs[e].append(launch(worker, 2, args, e, timeout=600)[0])
    best = {e: min(r, key=lambda x: x["step_s"]) for e, r in runs.items()}
    result = {
        "expert_bytes_per_rank": {str(e): best[e]["expert_bytes"] for e in best},
        "router_bytes_per_rank": {str(e): best[e]["router_bytes"] for e in best},
        "expert_bytes_ratio": best[2]["expert_bytes"] / best[1]["expert_bytes"],
        "all_to_all_bytes_per_step": {str(e): best[e]["all_to_all_bytes_per_step"] for e in best},
        "step_s": {str(e): best[e]["step_s"] for e in best},
        "step_ratio": best[2]["step_s"] / best[1]["step_s"],
    }
    if args.json:
        emit_json(result)
        return
    print_table(
        ["experts", "expert MiB/rank", "router KiB/rank", "all-to-all MiB/step", "step ms"],
        [
            [
                "replicated (E=1)" if e == 1 else f"split (E={e})",
                best[e]["expert_bytes"] / 2**20,
                best[e]["router_bytes"] / 2**10,
                best[e]["all_to_all_bytes_per_step"] / 2**20,
                best[e]["step_s"] * 1e3,
            ]
            for e in (1, 2)
        ],
    )
    ratio, step = result["expert_bytes_ratio"], result["step_ratio"]
    print(f"expert bytes E=2 / E=1: {ratio:.3f} (goal 0.5); step time E=2 / E=1: {step:.2f}")


if __name__ == "__main__":
    main()
