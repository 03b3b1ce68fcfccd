"""``python -m lightning_pipe.plan MODEL --devices N --memory 16GB --batch B --seq S``: the layouts
``pipe_tp`` could run MODEL with on N processes, ranked by predicted step time, from measurements
on this machine's device; no process group, no training run (what ``layout="auto"`` decides in a run).

MODEL is either ``package.module:Factory`` (a class or function called without arguments, whose
result has ``configure_pipeline()``, built with its parameters on the meta device; its
``tensor_parallel_plan()``, if any, says which tensor sizes it accepts), or a Hugging Face config:
a directory with ``config.json``, the file itself, or a model name already in the local cache
(nothing is downloaded). Each layer is copied to the device on its own to be timed, so a model
larger than the device is measured too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lightning_pipe.planning.auto as planning_auto
from lightning_pipe.construction.meta import parameters_on_meta
from lightning_pipe.execution.layers import bind_layers
from lightning_pipe.execution.recompute import RecomputeMode
from lightning_pipe.planning.candidates import (
    Constraints,
    DataMode,
    ModelShape,
    enumerate_candidates,
    microbatch_rows,
    shards_parameters,
    splits_backward,
)
from lightning_pipe.planning.costs import GB, Links, Machine, format_bytes
from lightning_pipe.planning.measure import (
    accepted_tensor_sizes,
    adamw,
    compute_slots,
    device_memory,
    measure_model,
    measurement_sizes,
)
from lightning_pipe.planning.planner import plan_layout
from lightning_pipe.planning.report import render
from lightning_pipe.schedule.builders import ScheduleKind

_WHERE = "python -m lightning_pipe.plan"


@dataclass
class LoadedModel:
    """What the planner measures of a model."""

    root: nn.Module
    """The module whose names the tensor-parallel plan uses."""
    layers: list[nn.Module]
    """The pipeline layers, as the executor calls them."""
    plan_for: Callable[[int], Mapping[str, str] | None]
    sample_at: Callable[[int], Any]
    """The first layer's input for a micro-batch of so many samples."""


def _token_ids(layers: list[nn.Module], rows: int, seq: int) -> torch.Tensor:
    embedding = next((m for m in layers[0].modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(
            f"{_WHERE} could not make a sample: the first pipeline layer holds no nn.Embedding to draw token "
            "ids for, and the model sets no example_input_array. Set self.example_input_array to one "
            "sample's pipeline input."
        )
    return torch.randint(0, embedding.num_embeddings, (rows, seq))


def _rows_of(example: Any, rows: int) -> Any:
    if isinstance(example, tuple | list):
        return tuple(_rows_of(t, rows) for t in example)
    return example[:1].expand(rows, *example.shape[1:]).clone()


def load_factory(spec: str, seq: int, init_args: Mapping[str, Any] | None = None) -> LoadedModel:
    """``package.module:Factory`` called with ``init_args``, its parameters on the meta device."""
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    with parameters_on_meta(_WHERE):
        model = factory(**(init_args or {}))
        if callable(getattr(model, "configure_model", None)):
            model.configure_model()
    layers = list(model.configure_pipeline())
    plan_hook = getattr(model, "tensor_parallel_plan", None)
    example = getattr(model, "example_input_array", None)

    def sample_at(rows: int) -> Any:
        return _token_ids(layers, rows, seq) if example is None else _rows_of(example, rows)

    return LoadedModel(model, layers, lambda t: plan_hook() if callable(plan_hook) else None, sample_at)


def load_huggingface(spec: str, seq: int) -> LoadedModel:
    """A Hugging Face causal LM from its config (local only), built on the meta device, as the
    pipeline ``pipe_tp`` derives from it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_pipe.huggingface.pipeline import CausalLMPipeline

    path = Path(spec)
    config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else spec), local_files_only=True)
    config.use_cache = False
    with parameters_on_meta(_WHERE):
        model = AutoModelForCausalLM.from_config(config)
    pipeline = CausalLMPipeline(model)
    layers = bind_layers(pipeline.layers(), pipeline.calls())
    vocab = int(config.vocab_size)

    def sample_at(rows: int) -> Any:
        return pipeline.pipeline_input(torch.randint(0, vocab, (rows, seq)))

    return LoadedModel(model, layers, lambda t: pipeline.tensor_parallel_plan(t).plan, sample_at)


def load_model(spec: str, seq: int, init_args: Mapping[str, Any] | None = None) -> LoadedModel:
    """A factory (``module:Factory``, called with ``init_args``) or a Hugging Face config."""
    if Path(spec).exists() or ":" not in spec:
        if init_args:
            raise ValueError(f"--init-args applies to a module:Factory model, not to the config {spec!r}.")
        return load_huggingface(spec, seq)
    return load_factory(spec, seq, init_args)


def parse_memory(text: str) -> float:
    """``"16GB"``, ``"512MiB"``, ``"4"`` (gigabytes) -> bytes."""
    try:
        return planning_auto.parse_memory(text, bare_unit=GB)
    except ValueError:
        raise argparse.ArgumentTypeError(f"memory like 16GB, 512MiB or 4 (gigabytes), got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_WHERE, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", help="package.module:Factory, or a Hugging Face config directory, file or cached name"
    )
    parser.add_argument(
        "--init-args",
        type=json.loads,
        help="the factory's keyword arguments as JSON, e.g. '{\"n_layers\": 8}'",
    )
    parser.add_argument("--devices", type=int, required=True, help="processes to plan for (all nodes)")
    parser.add_argument(
        "--memory", type=parse_memory, help="memory per process (default: the CUDA device's free memory)"
    )
    parser.add_argument(
        "--batch", type=int, required=True, help="samples per optimizer step, all replicas together"
    )
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample (default 128)")
    parser.add_argument(
        "--rows", type=int, help="samples per measured micro-batch (default: batch / devices / 2)"
    )
    parser.add_argument("--device", help="where to measure (default: cuda if available, else cpu)")
    parser.add_argument(
        "--optimizer-state-factor",
        type=float,
        default=2.0,
        help="optimizer bytes per parameter byte (AdamW 2, SGD 0)",
    )
    parser.add_argument("--bandwidth", type=_positive, default=5.0, help="GB/s between processes (default 5)")
    parser.add_argument(
        "--latency", type=_non_negative, default=20.0, help="microseconds per message (default 20)"
    )
    parser.add_argument(
        "--collective-bandwidth",
        type=_positive,
        help="GB/s of all-reduce, reduce-scatter and all-gather per link, if not --bandwidth",
    )
    parser.add_argument(
        "--collective-latency", type=_non_negative, help="microseconds per collective step, if not --latency"
    )
    parser.add_argument(
        "--collective-wait",
        type=_non_negative,
        default=0.0,
        help="microseconds each collective waits for its last rank where the processes share cores "
        "(default 0; layout='auto' probes it in the run's process group)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="on CPU, threads to measure with (default: this host's cores / devices, as each of the "
        "processes would share them)",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        help="whether the data axis' communication hides behind compute (default: on CUDA, not on CPU)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per layer and size (median; default 3)"
    )
    parser.add_argument("--top", type=int, default=5, help="rows of the table (default 5)")
    parser.add_argument("--json", action="store_true", help="print the ranked predictions as JSON")
    fixed = parser.add_argument_group("constraints (kept as given; the rest is chosen)")
    fixed.add_argument("--pipeline-parallel-size", type=int)
    fixed.add_argument("--tensor-parallel-size", type=int)
    fixed.add_argument("--data-parallel-size", type=int)
    fixed.add_argument("--data-mode", choices=[m.value for m in DataMode])
    fixed.add_argument("--schedule", choices=[k.value for k in ScheduleKind])
    fixed.add_argument("--virtual-stages", type=int)
    fixed.add_argument("--num-microbatches", type=int)
    fixed.add_argument("--recompute", choices=[r.value for r in RecomputeMode])
    return parser


def _number(text: str, positive: bool) -> float:
    """A number > 0 (``positive``) or >= 0 for argparse, which turns the error into a usage line
    and exit status 2."""
    bound = "> 0" if positive else ">= 0"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    return _number(text, positive=False)


def _positive(text: str) -> float:
    return _number(text, positive=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    memory = args.memory if args.memory is not None else device_memory(device)
    if memory is None:
        print(
            f"{_WHERE}: give --memory (e.g. --memory 16GB): on {device.type} no free memory can be read.",
            file=sys.stderr,
        )
        return 2
    constraints = Constraints(
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        data_mode=DataMode.parse(args.data_mode) if args.data_mode else None,
        schedule=ScheduleKind.parse(args.schedule) if args.schedule else None,
        virtual_stages=args.virtual_stages,
        num_microbatches=args.num_microbatches,
        recompute=RecomputeMode.parse(args.recompute) if args.recompute else None,
    )
    if device.type == "cpu":
        # The processes of a CPU run share this host's cores: a layer timed on all of them would
        # look faster than any rank will run it (and oversubscribed threads much slower).
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.devices))
    loaded = load_model(args.model, args.seq, args.init_args)
    sizes, splits = accepted_tensor_sizes(loaded.root, loaded.layers, loaded.plan_for, args.devices)
    shape = ModelShape(len(loaded.layers), sizes)
    try:  # a constraint no layout meets is said before anything is measured
        candidates = enumerate_candidates(args.devices, shape, args.batch, constraints)
    except ValueError as err:
        print(f"{_WHERE}: {err}", file=sys.stderr)
        return 2
    rows = args.rows or max(1, args.batch // args.devices // 2)
    split = splits[min(splits)] if splits else None  # the same modules split at any size
    costs = measure_model(
        loaded.layers,
        loaded.sample_at,
        rows,
        device,
        split,
        args.repeats,
        args.optimizer_state_factor,
        optimizer=adamw,  # the step's time as AdamW's, whose state the memory's factor 2 assumes
        sizes=measurement_sizes(microbatch_rows(candidates, args.batch), rows),
        sharded=shards_parameters(candidates),
        split_backward=splits_backward(candidates),
    )
    layers = costs.layers
    links = Links(
        p2p_bandwidth=args.bandwidth * GB,
        p2p_latency=args.latency * 1e-6,
        collective_bandwidth=(args.collective_bandwidth or args.bandwidth) * GB,
        collective_latency=(args.collective_latency if args.collective_latency is not None else args.latency)
        * 1e-6,
        # On CPU the processes' communication runs on the cores that compute (gloo): nothing hides.
        overlap_data_parallel=args.overlap if args.overlap is not None else device.type == "cuda",
    )
    # On CPU the processes share this host's cores: as many compute at once as the cores allow.
    machine = Machine(
        args.devices,
        memory,
        links,
        compute_slots=compute_slots(device, args.devices),
        collective_wait_seconds=args.collective_wait * 1e-6,
    )
    plan = plan_layout(costs, machine, shape, args.batch, constraints)
    if args.json:
        print(
            json.dumps(
                [_as_json(p) for p in plan.predictions[: args.top]] + [{"why": plan.refusal}], indent=1
            )
        )
    else:
        print(
            f"{args.model}: {len(layers)} pipeline layers measured on {device} at {rows} samples x "
            f"{args.seq} tokens per micro-batch; {args.devices} processes, {format_bytes(memory)} each, "
            f"batch {args.batch}."
        )
        print(render(plan, args.top))
    return 0 if plan.best is not None else 1


def _as_json(p: Any) -> dict[str, Any]:
    out = asdict(p)
    out["candidate"] = {"layout": str(p.candidate), **p.candidate.options()}
    out["peak_bytes"] = p.peak_bytes
    return out


if __name__ == "__main__":
    sys.exit(main())
