"""Hugging Face causal LMs of ten families, pipelined from their own plans with no wrappers, train
like the model's own single-process forward at pp=2, pp=2 x tp=2 and dp=2 x pp=2 (and three of
them with the data axis fully sharded, ``shard_parameters``), on padded batches and on packed
sequences.

Each rank builds the same tiny random model, derives its pipeline (``CausalLMPipeline``: the
plan's modules in order, masks and rotary tables rebuilt per stage, the family's prologue and
epilogue) and its tensor-parallel plan from the model's public ``tp_plan``, and trains three SGD
steps with the engine (``ParallelRuntime.train_batch``), micro-batch losses weighted by their
tokens. The test process trains the same model on the whole batches (once per family and kind,
for all the layouts), and rank 0 compares every loss, every gradient of the first step and every
weight after the last with it: 1e-9 in float64 (the families whose own forward runs in float64),
1e-5 in float32.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.huggingface import CausalLMPipeline
from lightning_pipe.huggingface.outputs import causal_lm_loss
from lightning_pipe.mesh import MeshAxis, ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.batch import Microbatch
from lightning_pipe.tensor_parallel.regions import sequence_active
from tests.distributed import run_distributed
from tests.hf_families import FAMILIES, SEQ, batches, build, train_reference

pytestmark = pytest.mark.distributed

STEPS, BATCH, LR = 3, 8, 0.5
KINDS = ("padded", "packed")
LR_FLOAT32 = 0.1
"""The step of the float32 families. Every tensor-parallel layout sums partial products in its own
order, so its float32 gradients differ from one device's in the last bits (5.7e-7 at the first
step for gemma3_text); at lr 0.5 three steps amplify that chaotically in gemma3_text's padded case
(its weights: 6.6e-6 at pp2_tp2, 7.5e-6 or 1.4e-5 under sequence parallelism depending on whether
the column layers' partial gradients are summed across the ranks before or after each other), so
the comparison of weights would measure the amplification of rounding, not the implementation; at
0.1 the same runs differ by 2e-7. Float64 families keep 0.5 (their gaps are 1e-16)."""


def _gathered_grads(model: torch.nn.Module, runtime: ParallelRuntime) -> dict[str, Any]:
    """The whole model's gradients on rank 0 (each parameter's data swapped for its gradient)."""
    saved = []
    for param in runtime.parameters:
        grad = param.grad.detach() if param.grad is not None else torch.zeros_like(param)
        if isinstance(param, DTensor):  # shard_parameters: this rank's shard, copied in place
            with torch.no_grad():
                saved.append(param.to_local().clone())
                param.to_local().copy_(grad.to_local())
        else:
            saved.append(param.data)
            param.data = grad
    try:
        return gather_model_state(model, runtime.partition, runtime.mesh)
    finally:
        for param, data in zip(runtime.parameters, saved, strict=True):
            if isinstance(param, DTensor):
                with torch.no_grad():
                    param.to_local().copy_(data)
            else:
                param.data = data


def _head(output: torch.Tensor, microbatch: Microbatch) -> torch.Tensor:
    return causal_lm_loss(output, microbatch.data["labels"])


def _train(
    family: str,
    kind: str,
    layout: ParallelLayout,
    mesh: Any,
    references: dict[str, Any],
    shard: bool = False,
    sequence: bool = False,
) -> dict[str, Any]:
    family, _, variant = family.partition("+")
    dtype, lr = _float(family)
    float64 = dtype is torch.float64
    model = build(family, dtype)
    model._tp_plan = VARIANTS[variant](dict(model.tp_plan)) if variant else model.tp_plan
    pipeline = CausalLMPipeline(model)
    plan = (
        pipeline.tensor_parallel_plan(layout.tensor_parallel_size, sequence_parallel=sequence)
        if layout.tensor_parallel_size > 1
        else None
    )
    if sequence:  # the derived plan must be a sequence-parallel one, not tensor parallelism alone
        assert plan is not None and "sequence_gather" in plan.plan.values(), plan
    options = RuntimeOptions(
        # Two micro-batches per replica (each replica's half of the batch at dp=2): the tokens
        # weighting across micro-batches, the stages' exchanges and 1F1B's overlap are all there;
        # more would repeat each micro-batch's ~56 small collectives (tp=2) for no new path.
        num_microbatches=2,
        tensor_parallel_plan=plan.plan if plan is not None else None,
        timeout=timedelta(seconds=60),
        shard_parameters=shard,
        sequence_parallel=sequence,
    )
    # The sequence lengths this rank's decoder layers receive in training (not in the setup
    # check's whole probes): under sequence parallelism, each tensor rank's part.
    lengths: set[int] = set()
    for layer in getattr(pipeline.parts.base, pipeline.parts.layers_name):
        layer.register_forward_pre_hook(
            lambda _, args: lengths.add(args[0].shape[1]) if sequence_active() else None
        )
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=lr))
    dp_rank, dp = mesh.coordinates.dp_rank, layout.data_parallel_size
    losses, grads = [], {}
    for step, batch in enumerate(batches(kind, STEPS, BATCH)):
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        optimizer.zero_grad()
        runtime.begin_accumulation()
        result = runtime.train_batch(mine, _head)
        loss = torch.tensor([float(result.loss)], dtype=torch.float64)
        if dp > 1:  # each replica's loss is its own tokens' mean: the global one weights by tokens
            items = torch.tensor([float(pipeline.loss_items(mine).sum())], dtype=torch.float64)
            both = torch.cat([loss * items, items])
            dist.all_reduce(both, group=mesh.group(MeshAxis.DATA))
            loss = both[:1] / both[1:]
        losses.append(float(loss))
        if step == 0:
            grads = _gathered_grads(model, runtime)
        optimizer.step()
    last = gather_model_state(model, runtime.partition, mesh)
    runtime.close()
    if mesh.rank != 0:
        return {}
    expected = references[f"{family}/{kind}"]
    tol = 1e-9 if float64 else 1e-5
    gaps = {
        "losses": max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True)),
        "first-step gradients": max((grads[k] - v).abs().max().item() for k, v in expected["grads"].items()),
        "weights after the last step": max(
            (last[k] - v).abs().max().item() for k, v in expected["last"].items() if v.is_floating_point()
        ),
    }
    notes = plan.notes if plan is not None else []
    return {"gaps": gaps, "tol": tol, "dtype": str(dtype), "notes": notes, "lengths": sorted(lengths)}


def family_worker(
    sizes: tuple[int, int, int],
    families: list[str],
    references: str,
    shard: bool = False,
    sequence: bool = False,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    layout = ParallelLayout(*sizes)
    mesh = init_mesh(layout, "cpu")
    expected = torch.load(references, weights_only=True) if mesh.rank == 0 else {}
    return {
        f"{family}/{kind}": _train(family, kind, layout, mesh, expected, shard, sequence)
        for family in families
        for kind in KINDS
    }


_references: dict[str, dict[str, Any]] = {}
"""Each family's one-device training on each kind of batch, computed once for every layout."""


def _float(family: str) -> tuple[torch.dtype, float]:
    float64 = FAMILIES[family].float64
    return (torch.float64, LR) if float64 else (torch.float32, LR_FLOAT32)


def references_for(families: list[str], folder: Path) -> str:
    """A file with the one-device training of ``families`` (a variant's is its family's: the
    ``tp_plan`` changes nothing on one device) on both kinds of batches, for rank 0 to compare with.

    Trained here, in the test process, once per family and kind for the module's six launches,
    instead of by rank 0 of each launch while its peers wait; with one intra-op thread, as the
    ranks compute.
    """
    keys = {f"{family.partition('+')[0]}/{kind}" for family in families for kind in KINDS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for key in sorted(keys - _references.keys()):
            family, kind = key.split("/")
            dtype, lr = _float(family)
            _references[key] = train_reference(build(family, dtype), batches(kind, STEPS, BATCH), lr)
    finally:
        torch.set_num_threads(threads)
    path = folder / "references.pt"
    torch.save({key: _references[key] for key in keys}, path)  # what this launch compares with
    return str(path)


LAYOUTS = {
    "pp2": (1, 2, 1),
    "pp2_tp2": (1, 2, 2),
    "dp2_pp2": (2, 2, 1),
    "dp2_pp2_fsdp": (2, 2, 1),
    "tp2_sp": (1, 1, 2),
    "pp2_tp2_sp": (1, 2, 2),
}
SHARDED_FAMILIES = ["llama", "gemma3_text", "mixtral"]
"""Under ``shard_parameters``: tied embedding and head (llama), sliding and global layers with
several rotary tables (gemma3), experts (mixtral)."""
VARIANTS = {
    # Embedding and head left whole: split by the embedding's plan entry, gathered before the head.
    "whole_head": lambda plan: {k: v for k, v in plan.items() if "embed" not in k and "lm_head" not in k},
    # The model's own plan names norms with Hugging Face's style: the same as derived.
    "sp_entries": lambda plan: {
        **plan,
        "model.layers.*.input_layernorm": "sequence_parallel",
        "model.norm": "sequence_parallel",
    },
    # Experts left whole, computing each token alone (the model's plan says so).
    "moe_sp": lambda plan: {**plan, "model.layers.*.mlp": "sequence_parallel"},
}
"""``family+variant``: the family with its ``tp_plan`` changed so."""
SEQUENCE_FAMILIES = [
    "llama",
    "qwen3",
    "gemma3_text",
    "phi3",
    "gpt_neox",
    "llama+whole_head",
    "qwen3+sp_entries",
    "mixtral+moe_sp",
]
"""Under ``sequence_parallel``: the sequence split after a vocab-parallel tied embedding, gathered
by a column-parallel head (llama); per-head q/k norms inside the gathered attention, summed
(qwen3, gemma3 with four norms per layer and several rotary tables); gathered projections and
residual dropouts (phi3); a whole embedding split by its plan entry, an embedding dropout and
parallel residual blocks with biased row layers (gpt_neox); a whole tied embedding and head
(llama+whole_head); norms the model's plan names 'sequence_parallel' (qwen3+sp_entries); a
mixture of experts kept whole on each rank's part, which the model's plan vouches for
(mixtral+moe_sp)."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_families_train_like_their_own_forward(layout: str, tmp_path: Path) -> None:
    sizes = LAYOUTS[layout]
    world = sizes[0] * sizes[1] * sizes[2]
    shard = layout.endswith("_fsdp")
    sequence = layout.endswith("_sp")
    families = SHARDED_FAMILIES if shard else SEQUENCE_FAMILIES if sequence else list(FAMILIES)
    references = references_for(families, tmp_path)
    got = run_distributed(
        family_worker, world, sizes, families, references, shard, sequence, timeout=600, pg_timeout=120
    )[0]
    assert sorted(got) == sorted(f"{f}/{k}" for f in families for k in KINDS)
    failures = [
        f"{case} ({result['dtype']}): {what} differ by {gap:.2e} > {result['tol']:.0e}"
        for case, result in got.items()
        for what, gap in result["gaps"].items()
        if not gap <= result["tol"]
    ]
    assert failures == [], "\n".join(failures)
    # Rank 0's decoder layers saw its part of the sequence under sequence parallelism, else all.
    length = SEQ // sizes[2] if sequence else SEQ
    assert {case: result["lengths"] for case, result in got.items()} == {case: [length] for case in got}


def _no_targets_on_replica_one(steps: int) -> list[dict[str, torch.Tensor]]:
    """Padded batches whose second half (data-parallel replica 1's) has no target in step 0 (a
    prompt-only part of a supervised fine-tuning batch)."""
    out = batches("padded", steps, BATCH)
    out[0]["labels"][BATCH // 2 :] = -100
    return out


def empty_replica_worker() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(ParallelLayout(2, 1, 1), "cpu")
    model = build("llama", torch.float64)
    pipeline = CausalLMPipeline(model)
    options = RuntimeOptions(num_microbatches=2, timeout=timedelta(seconds=60))
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=LR))
    dp_rank = mesh.coordinates.dp_rank
    for batch in _no_targets_on_replica_one(STEPS):
        optimizer.zero_grad()
        runtime.begin_accumulation()
        runtime.train_batch({k: v.chunk(2)[dp_rank] for k, v in batch.items()}, _head)
        optimizer.step()
    last = gather_model_state(model, runtime.partition, mesh)
    runtime.close()
    return last if mesh.rank == 0 else {}


def test_a_replica_without_target_tokens_trains_like_one_device() -> None:
    """dp=2: replica 1's part of the first batch has no target token. It must not stop alone (the
    other replica would wait for it) and must weigh nothing: the global batch's mean over its
    tokens, as one device computes it."""
    last = run_distributed(empty_replica_worker, 2, timeout=300)[0]
    expected = train_reference(build("llama", torch.float64), _no_targets_on_replica_one(STEPS), LR)["last"]
    gap = max((last[k] - v).abs().max().item() for k, v in expected.items() if v.is_floating_point())
    assert gap <= 1e-9, gap
