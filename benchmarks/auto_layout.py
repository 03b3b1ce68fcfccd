"""How close the layout planner's predictions are: every layout it ranks, run for real next to
what it predicted (issue 47, "Must show").

For two models, the example GPT (``examples/gpt``'s ``CharGPT``) and a small Hugging Face Llama
(built from ``LlamaConfig``, nothing downloaded), on 4 gloo processes (one thread each):

1. the planner's inputs are measured as ``layout="auto"`` measures them
   (:func:`~lightning_pipe.planning.auto.probe_machine`): in the real process group, the links
   probed three times, each number the median
   (:func:`~lightning_pipe.planning.links.probe_links`), how many of the processes can compute at
   once (``compute_slots``: matrix products timed on one rank alone and on all four at once,
   :func:`~lightning_pipe.planning.cores.probe_compute_slots`; ``--slots-probe layers``: the
   model's own layers instead; at most 2 on a 2-core host, fewer when other jobs share it) and
   what each collective waits for its last rank
   (:func:`~lightning_pipe.planning.cores.probe_collective_wait`); then the layers timed one at a
   time by rank 0 with one thread (:func:`~lightning_pipe.planning.measure.measure_model`, the
   meta-built model materialised a layer at a time) while the other ranks wait, and the
   optimizer's step (AdamW) timed per layer;
2. the plan ranks every candidate; the benchmark runs the top ``--top`` (default 6) and, for a
   spread, the best-ranked candidate of every other layout (pipeline x tensor x data sizes and
   data mode) the planner considered: the table says which rows are which;
3. each is built once in the same 4 processes (a set of processes per model: runs leave their
   process groups behind; one mesh per layout, shared by its rows; its stages split as the planner
   split them), and the rows take turns (AdamW), ``--steps`` turns in each of ``--passes``
   passes (default 3), the order rotated each pass: the machine drifts over the minutes a pass
   takes (other jobs), and taking turns puts the drift on every row alike. A turn is ``--warmup``
   untimed steps and one timed step of the row: the first step after the other rows' finds the
   row's state out of the caches (the GPT's AdamW steps took 2 - 4x as long, stepped once per
   turn, as in a run of steps). Before the second pass and each later one the planner's inputs
   are measured again and every row predicted from them: ``same period`` compares each pass with the
   prediction from its own stretch of the machine, which separates the model's error from the
   drift since the plan. The measured step time is the median over the passes' steps of the
   slowest rank's (barrier to barrier: forward, backward, the data axis' reduction and the
   optimizer step; the ``optimizer ms`` column is the measured step's part); ``passes apart`` is
   how far the passes' medians of one row are from each other, the measurement's own noise beside
   the prediction's error.

Peak memory per rank is measured as the planner counts it, not as RSS (a peak RSS never goes down,
and these runs share processes; the allocator's slack is not what the planner predicts): the
bytes of parameters, gradients (the reducer's buckets where it has them) and optimizer state the
rank holds after a step, plus the executor's activation meter (``measure_activation_memory``:
the most bytes held for backward over the micro-batches alive at once, stage inputs and outputs
included), the meter told not to count the rank's own parameters (a weight autograd keeps for the
input gradient is not a second copy). The largest rank's total is compared.

Goals (printed with the verdict): each step time within 25% of its prediction; the ranking of the
planner's top three preserved by the measurements; each peak memory within 15%; the planner's pick
within 10% of the best measured step time.

Run: ``python benchmarks/auto_layout.py`` (table; about 7 minutes on 2
cores) or ``--json``; ``--models gpt`` or ``llama`` for one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _launch import emit_json, launch, median, print_table, warn_if_busy

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
TIMEOUT = timedelta(seconds=300)
MEMORY = 64e9
"""Bytes per process the planner is told: enough for every candidate (this benchmark compares
predictions; the memory limit's test is elsewhere)."""


@dataclass(frozen=True)
class Sizes:
    width: int
    layers: int
    seq: int
    batch: int
    rows: int | None = None
    """Samples per measured micro-batch (the layers are timed at it and twice it)."""
    measure_sizes: bool = True
    """Time the layers at the candidates' micro-batch sizes too (``--no-measure-sizes``: only at
    ``rows`` and twice them, the line through those two extrapolated)."""


def _gpt_parts(sizes: Sizes) -> tuple[Any, list[Any], Callable[[int], Any], Any]:
    """A meta-built CharGPT, its pipeline layers, the plan for ``t`` ranks and the loss head."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from gpt_model import CharGPT

    from lightning_pipe.construction.meta import parameters_on_meta
    from lightning_pipe.tensor_parallel import cross_entropy

    with parameters_on_meta():
        model = CharGPT(d_model=sizes.width, n_heads=4, n_layers=sizes.layers, max_len=sizes.seq)
        model.configure_model()
    return (
        model,
        model.configure_pipeline(),
        lambda t: model.tensor_parallel_plan(),
        (lambda out, mb: cross_entropy(out, mb.data[1])),
    )


def _gpt_batch(sizes: Sizes) -> Any:
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from gpt_model import MODEL_VOCAB

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL_VOCAB, (sizes.batch, sizes.seq + 1), generator=g)
    return (ids[:, :-1], ids[:, 1:])


VOCAB = 512


def _llama_config(sizes: Sizes) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=sizes.width,
        intermediate_size=2 * sizes.width,
        num_hidden_layers=sizes.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=sizes.seq,
        attn_implementation="sdpa",
        use_cache=False,
    )


def _llama_batch(sizes: Sizes) -> Any:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (sizes.batch, sizes.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------- the plan (rank 0)
def _load(name: str, sizes: Sizes) -> Any:
    """The model as ``python -m lightning_pipe.plan`` loads it: meta-built, its pipeline layers."""
    from lightning_pipe.plan import load_factory, load_huggingface

    if name == "gpt":
        sys.path.insert(0, str(ROOT / "examples" / "gpt"))
        return load_factory(
            "gpt_model:CharGPT",
            sizes.seq,
            {"d_model": sizes.width, "n_heads": 4, "n_layers": sizes.layers, "max_len": sizes.seq},
        )
    with tempfile.TemporaryDirectory() as where:
        _llama_config(sizes).save_pretrained(where)
        return load_huggingface(where, sizes.seq)


def _rows(sizes: Sizes) -> int:
    return sizes.rows or max(1, sizes.batch // WORLD // 2)  # python -m lightning_pipe.plan's default


def _machine(loaded: Any, sizes: Sizes, probe: str) -> Any:
    """The machine as ``layout="auto"`` probes it in the group (the links, the compute slots, the
    wait at each collective), the slots probed with the model's own layers (the layer profiler
    over one measured micro-batch, its warm-up run included: the probe times the whole call, alone
    and on all ranks at once) or ``"matrix"`` products."""
    from lightning_pipe.partition.profile import profile_layers
    from lightning_pipe.planning.auto import probe_machine

    def layers() -> None:
        profile_layers(loaded.layers, loaded.sample_at(_rows(sizes)), torch.device("cpu"), 1)

    return probe_machine(torch.device("cpu"), MEMORY, slots_work=layers if probe == "layers" else None)


def _plan(loaded: Any, sizes: Sizes, machine: Any, repeats: int) -> tuple[Any, Any, Any]:
    """What ``layout="auto"`` would measure and decide, on this rank: (plan, costs, machine)."""
    from lightning_pipe.planning import Constraints, ModelShape, enumerate_candidates, plan_layout
    from lightning_pipe.planning.candidates import microbatch_rows, shards_parameters, splits_backward
    from lightning_pipe.planning.measure import accepted_tensor_sizes, measure_model, measurement_sizes

    tensor_sizes, splits = accepted_tensor_sizes(loaded.root, loaded.layers, loaded.plan_for, WORLD)
    split = splits[min(splits)] if splits else None
    shape = ModelShape(len(loaded.layers), tensor_sizes)
    candidates = enumerate_candidates(WORLD, shape, sizes.batch, Constraints())
    needed = microbatch_rows(candidates, sizes.batch)
    costs = measure_model(
        loaded.layers,
        loaded.sample_at,
        _rows(sizes),
        torch.device("cpu"),
        split,
        repeats,
        optimizer=_optimizer,
        sizes=measurement_sizes(needed, _rows(sizes)) if sizes.measure_sizes else (),
        sharded=shards_parameters(candidates),
        split_backward=splits_backward(candidates),
    )
    plan = plan_layout(costs, machine, shape, sizes.batch)
    return plan, costs, machine


def _optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The runs' optimizer (timed per layer by the planner, stepped by every run)."""
    return torch.optim.AdamW(params, lr=1e-4)


def _layout_key(c: Any) -> tuple[Any, ...]:
    return (c.pipeline_parallel_size, c.tensor_parallel_size, c.data_parallel_size, c.data_mode,
            c.reshard_after_forward)  # fmt: skip


def choose(predictions: list[Any], top: int) -> list[tuple[Any, str]]:
    """The top ``top`` predictions, then the best-ranked of every other layout: (prediction, why)."""
    chosen = [(p, "top") for p in predictions[:top]]
    seen = {_layout_key(p.candidate) for p, _ in chosen}
    for p in predictions[top:]:
        if _layout_key(p.candidate) not in seen:
            seen.add(_layout_key(p.candidate))
            chosen.append((p, "spread"))
    return chosen


# ----------------------------------------------------------------------------- one run
def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None or t.is_meta:
        return 0
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


@contextlib.contextmanager
def _meter_without(pointers: set[int]) -> Iterator[None]:
    """The executor's activation meter, not counting tensors stored where this rank's parameters
    are (a weight autograd saves for the input gradient is the parameter, not a copy)."""
    import lightning_pipe.execution.executor as executor_module
    from lightning_pipe.execution import memory

    original = executor_module.counting_saved

    def counting_saved(saved: memory.Counted, on: bool = True) -> Any:
        if not on:
            return contextlib.nullcontext()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in pointers:
                saved[(tensor.data_ptr(), tensor.nbytes)] = tensor.nbytes
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    executor_module.counting_saved = counting_saved
    try:
        yield
    finally:
        executor_module.counting_saved = original


class _Row:
    """One candidate built in these processes (its own runtime over the mesh of its layout), kept
    for the whole run so that the rows' steps can take turns: every row then meets the same
    stretch of the machine's drift."""

    def __init__(self, name: str, sizes: Sizes, candidate: Any, balance: list[int], meshes: dict[Any, Any]):
        from torch.distributed.tensor import DTensor

        from lightning_pipe.mesh import ParallelLayout, init_mesh
        from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions

        c = candidate
        options = {
            k: v for k, v in c.options().items() if not k.endswith("_parallel_size") and k != "partition"
        }
        hooks, init = None, None
        if name == "gpt":
            model, layers, plan_for, head = _gpt_parts(sizes)
            batch = _gpt_batch(sizes)
            plan = plan_for(c.tensor_parallel_size) if c.tensor_parallel_size > 1 else None
        else:
            from transformers import LlamaForCausalLM

            from lightning_pipe.construction.meta import parameters_on_meta
            from lightning_pipe.huggingface import CausalLMPipeline
            from lightning_pipe.huggingface.outputs import causal_lm_loss

            with parameters_on_meta():
                model = LlamaForCausalLM(_llama_config(sizes))
            pipeline = CausalLMPipeline(model)
            plan = (
                pipeline.tensor_parallel_plan(c.tensor_parallel_size).plan
                if c.tensor_parallel_size > 1
                else None
            )
            hooks, layers, batch = pipeline.hooks(), pipeline.layers(), _llama_batch(sizes)
            init = model._init_weights  # a Hugging Face model initialises its modules itself

            def head(out: Any, mb: Any) -> Any:
                return causal_lm_loss(out, mb.data["labels"])

        # One mesh per layout, shared by its rows (runtimes reuse a mesh's groups; each row steps
        # alone): 17 rows' own meshes would leave several times the groups alive.
        layout = ParallelLayout(c.data_parallel_size, c.pipeline_parallel_size, c.tensor_parallel_size)
        if layout not in meshes:
            meshes[layout] = init_mesh(layout, "cpu")
        mesh = meshes[layout]
        self.runtime = ParallelRuntime(
            model, layers, mesh, torch.device("cpu"),
            RuntimeOptions(**options, partition=balance, tensor_parallel_plan=plan, timeout=TIMEOUT),  # type: ignore[arg-type]
            seed=0, hooks=hooks, init=init,
        )  # fmt: skip
        self.optimizer = self.runtime.keep_own(_optimizer(list(model.parameters())))
        self.head = head
        dp, dp_rank = c.data_parallel_size, mesh.coordinates.dp_rank
        share = sizes.batch // dp
        if isinstance(batch, dict):
            self.mine: Any = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch.items()}
        else:
            self.mine = tuple(t[dp_rank * share : (dp_rank + 1) * share] for t in batch)
        self.pointers = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in self.runtime.parameters
            if not p.is_meta
        }
        self.activations: float | None = None
        self._last: Any = None
        run = self.runtime.executor.run

        def recording_run(*args: Any, **kwargs: Any) -> Any:
            self._last = run(*args, **kwargs)
            return self._last

        self.runtime.executor.run = recording_run  # type: ignore[method-assign]
        self.steps: list[list[float]] = []
        """Per pass, each timed step's seconds on this rank."""
        self.optimizer_steps: list[float] = []

    def step(self) -> tuple[float, float]:
        """One training step, barrier to barrier (the first also meters the activations, which
        costs time: it is a warm-up step): (its seconds, the optimizer step's)."""
        meter = self.activations is None
        self.runtime.executor.measure_activation_memory = meter
        with _meter_without(self.pointers) if meter else contextlib.nullcontext():
            dist.barrier()
            start = time.perf_counter()
            self.optimizer.zero_grad()
            self.runtime.begin_accumulation()
            self.runtime.train_batch(self.mine, self.head)
            before_step = time.perf_counter()
            self.optimizer.step()
            after_step = time.perf_counter()
            dist.barrier()
        seconds = time.perf_counter() - start
        # Under ZeRO-1 the step launches the parameters' all-gathers and leaves them to the next
        # forward (as in training: this step's forward waited for the previous step's, timed), and
        # until then a guard on the torch-function mode stack sends every torch call of the thread
        # through Python (data_parallel.parameter_gather). Left there, it slowed every other row's
        # steps and the planner's inputs measured between passes (the Llama's layers' forward 2x:
        # 52 against 25 ms with 6 ZeRO-1 rows' guards on the stack, 25 once waited for): wait for
        # them before another row runs, untimed.
        self.runtime.wait_for_parameters()
        if meter:
            self.activations = float(self._last.peak_held_bytes)
        return seconds, after_step - before_step

    def memory(self) -> dict[str, float]:
        reducer = getattr(getattr(self.runtime, "gradients", None), "reducer", None)
        params = list(self.runtime.parameters)
        if reducer is not None:
            grads = sum(_local_bytes(b.buffer) for b in reducer._buckets)
        else:
            grads = sum(_local_bytes(p.grad) for p in params)
        state = sum(
            _local_bytes(v) for s in self.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )  # fmt: skip
        return {
            "parameters": sum(_local_bytes(p) for p in params),
            "gradients": grads,
            "optimizer": state,
            "activations": self.activations or 0.0,
        }


def _inputs(loaded: Any, sizes: Sizes, probe: str, repeats: int) -> tuple[Any, Any, Any]:
    """The planner's inputs measured now (the machine in the group, the layers and the optimizer
    on rank 0): (plan, costs, machine) on rank 0, Nones elsewhere."""
    machine = _machine(loaded, sizes, probe)  # just before the plan: the load changes
    if dist.get_rank() != 0:
        return None, None, None
    return _plan(loaded, sizes, machine, repeats)


def worker(
    name: str, size: Sizes, top: int, warmup: int, steps: int, repeats: int, probe: str, passes: int
) -> dict[str, Any]:
    """One model's rows, in processes of its own: the planner's pick and spread, every row built
    once, then ``passes`` passes, each measuring the planner's inputs again (its predictions for
    the same period) and then running every row in turn."""
    from lightning_pipe.planning.cost_model import predict
    from lightning_pipe.planning.stage_costs import stage_balance

    box: list[Any] = [None]
    loaded = _load(name, size)
    plan, costs, machine = _inputs(loaded, size, probe, repeats)
    if dist.get_rank() == 0:
        chosen = choose(list(plan.predictions), top)
        box[0] = (chosen, [stage_balance(costs, p.candidate) for p, _ in chosen], machine)
    dist.barrier()
    dist.broadcast_object_list(box, 0)
    chosen, balances, machine = box[0]
    meshes: dict[Any, Any] = {}
    rows = [
        _Row(name, size, p.candidate, balance, meshes)
        for (p, _), balance in zip(chosen, balances, strict=True)
    ]
    # The processes' first steps pay for their first allocations (the allocator's arenas, pages
    # touched for the first time) beyond a row's warm-up: step the first row once before.
    rows[0].step()
    again: list[list[float]] = []
    """Per pass, every row's prediction from the inputs measured at the pass's start."""
    machines: list[Any] = []
    for turn in range(passes):
        if turn:
            # The machine drifts over the minutes a run takes (other jobs, the host's clock): the
            # inputs measured again next to the pass, and each row predicted from them, separate
            # the model's error from the drift since the plan.
            _, costs, machine_now = _inputs(loaded, size, probe, repeats)
        else:
            machine_now = machine
        if dist.get_rank() == 0:
            machines.append(machine_now)
            again.append(
                [predict(p.candidate, costs, machine_now, size.batch).step_seconds for p, _ in chosen]
            )
        # Rows take turns (the order turning each pass), so that a drift within the pass falls on
        # every row alike. A turn is ``warmup`` untimed steps and one timed: a row's first step
        # after the others' finds its state out of the caches (stepped alone after 16 other rows,
        # the AdamW step of the GPT's rows took 2 - 4x its time within a run of steps).
        order = list(range(len(rows)))
        order = order[turn % len(rows) :] + order[: turn % len(rows)]
        for row in rows:
            row.steps.append([])
        for _ in range(steps):
            for index in order:
                for _ in range(warmup):
                    rows[index].step()
                seconds, optimizer_seconds = rows[index].step()
                rows[index].steps[-1].append(seconds)
                rows[index].optimizer_steps.append(optimizer_seconds)
    out = {
        "links": machine.links,
        "chosen": chosen,
        "balances": balances,
        "machine": machine,
        "again": again,
        "machines": machines,
        "runs": [
            {"step": row.steps, "optimizer": row.optimizer_steps, "memory": row.memory()} for row in rows
        ],
    }
    for row in rows:
        row.runtime.close()
    return out


# ----------------------------------------------------------------------------- the table
def _ranks_agree(predicted: list[float], measured: list[float], k: int = 3) -> bool:
    """Whether the planner's top ``k`` (by prediction) keep their order when measured."""
    order = sorted(range(len(predicted)), key=lambda i: predicted[i])[:k]
    return [measured[i] for i in order] == sorted(measured[i] for i in order)


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    first = results[0]
    rows = []
    for index, (prediction, why) in enumerate(first["chosen"]):
        # Per pass, each step's slowest rank; the row's time is the median over all passes' steps.
        by_pass = [
            [max(values) for values in zip(*(r["runs"][index]["step"][turn] for r in results), strict=True)]
            for turn in range(len(first["runs"][index]["step"]))
        ]
        measured = median([t for steps in by_pass for t in steps])
        pass_medians = [median(steps) for steps in by_pass]
        # Each pass against the prediction from the inputs measured at its start.
        again = [first["again"][turn][index] for turn in range(len(by_pass))]
        same_period = median([m / a for m, a in zip(pass_medians, again, strict=True)])
        per_rank = [r["runs"][index] for r in results]
        memory = max(sum(r["memory"].values()) for r in per_rank)
        rows.append({
            "layout": str(prediction.candidate),
            "why": why,
            "predicted_s": prediction.step_seconds,
            "measured_s": measured,
            "time_ratio": measured / prediction.step_seconds,
            "predicted_again_s": again,
            "time_ratio_same_period": same_period,
            "pass_spread": max(pass_medians) / min(pass_medians) - 1,
            # The slowest rank's median over all passes' steps, as the step time is taken.
            "optimizer_s": max(median(r["runs"][index]["optimizer"]) for r in results),
            "predicted_optimizer_s": prediction.optimizer_seconds,
            "predicted_peak_bytes": prediction.peak_bytes,
            "measured_peak_bytes": memory,
            "memory_ratio": memory / prediction.peak_bytes,
            "measured_parts": max((r["memory"] for r in per_rank), key=lambda m: sum(m.values())),
        })  # fmt: skip
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best = min(measured)
    pick = rows[0]["measured_s"]  # the planner's pick is its first row
    goals = {
        "time_within_25pct": all(0.75 <= r["time_ratio"] <= 1.25 for r in rows),
        "rows_within_25pct": sum(0.75 <= r["time_ratio"] <= 1.25 for r in rows),
        "rows_within_25pct_same_period": sum(0.75 <= r["time_ratio_same_period"] <= 1.25 for r in rows),
        "top3_order_kept": _ranks_agree(predicted, measured),
        "memory_within_15pct": all(0.85 <= r["memory_ratio"] <= 1.15 for r in rows),
        "pick_within_10pct_of_best": pick <= 1.10 * best,
    }
    machine = first["machine"]
    top3 = sorted(predicted)[:3]
    return {
        "top3_predicted_spread": top3[-1] / top3[0] - 1,
        "rows": rows,
        "goals": goals,
        "pick_over_best": pick / best,
        "compute_slots": machine.compute_slots,
        "compute_slots_again": [m.compute_slots for m in first["machines"]],
        "collective_wait_s": machine.collective_wait_seconds,
        "collective_wait_again_s": [m.collective_wait_seconds for m in first["machines"]],
        "median_pass_spread": median([r["pass_spread"] for r in rows]),
    }


MODELS = {"gpt": "example GPT (CharGPT)", "llama": "Hugging Face Llama (LlamaConfig)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--top", type=int, default=6, help="the planner's top candidates run (then a spread)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed one")
    parser.add_argument("--steps", type=int, default=4, help="turns per pass: a timed step per row each")
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="passes over the rows (the rows taking turns a step at a time), the planner's inputs "
        "measured again before each",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per layer when measuring")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, help="samples per measured micro-batch (default batch / 4 / 2)")
    parser.add_argument(
        "--slots-probe",
        choices=["layers", "matrix"],
        default="matrix",
        help="what the compute-slot probe times alone and on all ranks at once (default: matrix products, "
        "as layout='auto' does)",
    )
    parser.add_argument(
        "--no-measure-sizes",
        dest="measure_sizes",
        action="store_false",
        help="time the layers only at --rows and twice them (the line through them extrapolated), not at "
        "the micro-batch sizes the candidates run",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.passes < 1 or args.steps < 1:
        parser.error(f"--passes and --steps must be at least 1, got {args.passes} and {args.steps}.")
    warn_if_busy()
    sizes = {
        name: Sizes(
            width=128,
            layers=6,
            seq=args.seq,
            batch=args.batch,
            rows=args.rows,
            measure_sizes=args.measure_sizes,
        )
        for name in MODELS
    }
    start = time.monotonic()
    # Each model in processes of its own: every candidate's run leaves its process groups behind
    # (their threads and connections), and the second model measured after the first's 35 runs in
    # the same processes took about twice its steps measured alone (passes of one row 55 - 346%
    # apart, against 19% alone).
    results = {
        name: launch(
            worker,
            WORLD,
            name,
            sizes[name],
            args.top,
            args.warmup,
            args.steps,
            args.repeats,
            args.slots_probe,
            args.passes,
            timeout=1800,
        )
        for name in args.models
    }
    summaries = {name: summarise(results[name]) for name in args.models}
    links = {name: results[name][0]["links"] for name in args.models}
    if args.json:
        emit_json({"sizes": {k: vars(v) for k, v in sizes.items()},
                   "links": {k: repr(v) for k, v in links.items()},
                   "results": summaries, "seconds": time.monotonic() - start})  # fmt: skip
        return
    print(f"{WORLD} gloo processes, 1 thread each, on {os.cpu_count()} cores")
    for name in args.models:
        s = summaries[name]
        size = sizes[name]
        print(f"\n{MODELS[name]}: width {size.width}, {size.layers} blocks, batch {size.batch} x {size.seq}")
        print(f"links: {links[name]}")
        again = ", ".join(f"{v:.2f}" for v in s["compute_slots_again"])
        print(f"compute slots probed: {s['compute_slots']:.2f} of {WORLD} processes (at each pass: {again})")
        waits = ", ".join(f"{v * 1e3:.1f}" for v in s["collective_wait_again_s"])
        print(
            f"wait at each collective probed: {s['collective_wait_s'] * 1e3:.1f} ms (at each pass: {waits})"
        )
        table = [
            [
                str(i), r["layout"], r["why"], f"{r['predicted_s'] * 1e3:.0f}",
                f"{r['measured_s'] * 1e3:.0f}", f"{r['pass_spread']:.0%}", f"{r['time_ratio']:.2f}",
                f"{r['time_ratio_same_period']:.2f}",
                f"{r['optimizer_s'] * 1e3:.0f}",
                f"{r['predicted_peak_bytes'] / 1e6:.1f}", f"{r['measured_peak_bytes'] / 1e6:.1f}",
                f"{r['memory_ratio']:.2f}",
            ]
            for i, r in enumerate(s["rows"], 1)
        ]  # fmt: skip
        print_table(
            ["#", "layout", "row", "pred ms", "meas ms", "passes apart", "meas/pred", "same period",
             "optimizer ms", "pred MB", "meas MB", "meas/pred"],
            table,
        )  # fmt: skip
        g = s["goals"]
        verdict = ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in g.items() if isinstance(v, bool))
        print(
            f"pick / best measured: {s['pick_over_best']:.2f}; rows within 25%: {g['rows_within_25pct']} of "
            f"{len(s['rows'])} ({g['rows_within_25pct_same_period']} against the inputs measured at each "
            f"pass); the top three predicted within {s['top3_predicted_spread']:.1%} of each "
            f"other; one layout's passes apart by {s['median_pass_spread']:.0%} (median over the rows)"
        )
        print(verdict)
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
