"""What ``compile`` (``torch.compile`` per pipeline layer) buys on this CPU, and what it costs.

Two models, each trained at pp=2 (two gloo processes, 1F1B, 4 micro-batches) through the engine
(``ParallelRuntime.train_batch``), eager and then compiled (inductor, ``torch.compile``'s default),
in the same processes, one after the other: the example GPT (``examples/gpt``'s ``CharGPT``) and a
small Hugging Face Llama pipelined by ``CausalLMPipeline``. For each: the median step time (after
warm-up steps) eager and compiled, their ratio, and the compile time (the compiled run's first
steps, which trace and generate code, minus eager steps of the same count). The slower pipeline
rank's numbers are reported (a step ends when both have).

Run: ``python benchmarks/compile.py`` (table) or ``--json``; ``--steps``, ``--width``, ``--layers``
set the sizes.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from _launch import emit_json, launch, median, print_table, warn_if_busy

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2
"""Steps of each run not timed: the compiled run's first steps compile (its compile time)."""


def _gpt(width: int, layers: int, seq: int) -> tuple[Any, list[Any], Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from gpt_model import MODEL_VOCAB, CharGPT

    from lightning_pipe.tensor_parallel import cross_entropy

    torch.manual_seed(0)
    model = CharGPT(d_model=width, n_heads=4, n_layers=layers, max_len=seq)
    model.configure_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL_VOCAB, (8, seq + 1), generator=g)
    batch = (ids[:, :-1], ids[:, 1:])
    return model, model.configure_pipeline(), batch, lambda out, mb: cross_entropy(out, mb.data[1]), None


def _llama(width: int, layers: int, seq: int) -> tuple[Any, list[Any], Any, Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pipe.huggingface import CausalLMPipeline
    from lightning_pipe.huggingface.outputs import causal_lm_loss

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    pipeline = CausalLMPipeline(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (8, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    return model, pipeline.layers(), batch, lambda out, mb: causal_lm_loss(out, mb.data["labels"]), pipeline


MODELS = {"example GPT": _gpt, "Hugging Face Llama": _llama}


def _run(name: str, width: int, layers: int, seq: int, steps: int, compile: bool) -> dict[str, Any]:
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

    torch._dynamo.reset()
    model, pipeline_layers, batch, head, pipeline = MODELS[name](width, layers, seq)
    mesh = init_mesh(ParallelLayout(1, 2, 1), "cpu")
    options = RuntimeOptions(num_microbatches=4, timeout=timedelta(seconds=600), compile=compile)
    hooks = pipeline.hooks() if pipeline is not None else None
    runtime = ParallelRuntime(model, pipeline_layers, mesh, torch.device("cpu"), options, seed=0, hooks=hooks)
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=0.01))
    times = []
    for _ in range(WARMUP + steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        runtime.begin_accumulation()
        runtime.train_batch(batch, head)
        optimizer.step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    runtime.close()
    return {"warmup": sum(times[:WARMUP]), "step": median(times[WARMUP:])}


def worker(width: int, layers: int, seq: int, steps: int) -> dict[str, Any]:
    out = {}
    for name in MODELS:
        eager = _run(name, width, layers, seq, steps, False)
        compiled = _run(name, width, layers, seq, steps, True)
        out[name] = {"eager": eager, "compiled": compiled}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    results = launch(worker, 2, args.width, args.layers, args.seq, args.steps, timeout=1800)
    rows, payload = [], {}
    for name in MODELS:
        eager = max(r[name]["eager"]["step"] for r in results)
        compiled = max(r[name]["compiled"]["step"] for r in results)
        compile_s = max(r[name]["compiled"]["warmup"] - r[name]["eager"]["warmup"] for r in results)
        payload[name] = {
            "eager_step_ms": eager * 1e3,
            "compiled_step_ms": compiled * 1e3,
            "ratio": compiled / eager,
            "compile_s": compile_s,
        }
        rows.append(
            [
                name,
                f"{eager * 1e3:.1f}",
                f"{compiled * 1e3:.1f}",
                f"{compiled / eager:.2f}",
                f"{compile_s:.1f}",
            ]
        )
    if args.json:
        emit_json({"sizes": vars(args), "results": payload})
    else:
        print(
            f"pp=2, 1F1B, 4 micro-batches of 2 x {args.seq} tokens, width {args.width}, {args.layers} layers"
        )
        print_table(["model", "eager step ms", "compiled step ms", "compiled / eager", "compile s"], rows)


if __name__ == "__main__":
    main()
