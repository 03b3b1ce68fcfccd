"""Hugging Face mixture-of-experts families with their experts split over an expert axis
(issue 45), from the model's own ``base_model_ep_plan`` with no wrappers, train like the model's
own forward on one process.

mixtral, qwen3_moe, deepseek_v3 (a shared expert, a dense first layer, grouped routing with a
correction bias) and gpt_oss (expert biases, its own clamped gate, attention sinks) at
``expert_parallel_size=2`` on two data ranks, two of them at E=2 x pp=2 and at E=2 x tp=2, and
qwen3_moe at E=2 x pp=2 x tp=2 (eight processes; also under ZeRO-1), on padded batches,
gradient clipping on (the threshold below every step's norm, so it always scales): every loss,
every router's logits in the first step and every weight after the last equal the family's own
forward on the whole batch in one process (float64 with the families' eager experts: 1e-9), and
every rank holds 1/E of each mixture-of-experts layer's experts (the block of its ``ep_rank``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeTPStrategy
from lightning_pipe.checkpoint import consolidate_checkpoint
from lightning_pipe.checkpoint.full import gather_model_state
from lightning_pipe.construction.materialize import materialize
from lightning_pipe.experts import expert_shard
from lightning_pipe.experts.apply import ExpertPlanError, shard_experts
from lightning_pipe.huggingface import CausalLMPipeline
from lightning_pipe.huggingface.outputs import causal_lm_loss
from lightning_pipe.huggingface.parts import UnsupportedModelError
from lightning_pipe.mesh import MeshAxis, ParallelLayout, init_mesh
from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
from lightning_pipe.runtime.batch import Microbatch
from lightning_pipe.runtime.sharding import describe_sharding
from tests.distributed import run_distributed
from tests.hf_families import COMMON, batches, reference_loss
from tests.hf_families import build as build_dense
from tests.test_huggingface_lightning import STEPS as LIGHTNING_STEPS
from tests.test_huggingface_lightning import TRAIN, HuggingFaceStep
from tests.trainers import fit

STEPS, BATCH, LR, MAX_NORM = 3, 8, 0.5, 0.5
EXPERTS = 4

MOE_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=EXPERTS, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=4,
            num_key_value_heads=4,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
}


def build(family: str, seed: int = 0) -> nn.Module:
    """The family's tiny model in float64 (its eager experts: grouped matrix products have no
    float64 kernel), norms, biases and routers' correction biases perturbed."""
    name, model_class, overrides = MOE_FAMILIES[family]
    config = getattr(transformers, name)(**{**COMMON, **overrides}, experts_implementation="eager")
    config.use_cache = False
    if family != "gpt_oss":
        config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or "bias" in pname or "sinks" in pname:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for bname, buffer in model.named_buffers():
            if "e_score_correction_bias" in bname:
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model.to(torch.float64).train()


def _routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]


def _record_routers(model: nn.Module, into: dict[str, list[torch.Tensor]]) -> list[Any]:
    """Each router's logits, in call order (forward passes only, not recomputation)."""
    handles = []
    for name, router in _routers(model):

        def hook(_: nn.Module, __: Any, out: Any, name: str = name) -> None:
            # Not in a backward (a recomputed forward runs inside one).
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                into.setdefault(name, []).append(out[0].detach().reshape(-1, EXPERTS).clone())

        handles.append(router.register_forward_hook(hook))
    return handles


def _head(output: torch.Tensor, microbatch: Microbatch) -> torch.Tensor:
    return causal_lm_loss(output, microbatch.data["labels"])


def _reference(family: str) -> dict[str, Any]:
    model = build(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, routers = [], [], {}
    for step, batch in enumerate(batches("padded", STEPS, BATCH)):
        optimizer.zero_grad()
        recorded: dict[str, list[torch.Tensor]] = {}
        handles = _record_routers(model, recorded) if step == 0 else []
        loss = reference_loss(model, batch)
        for h in handles:
            h.remove()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append(float(loss.detach()))
        if step == 0:
            routers = {k: torch.cat(v) for k, v in recorded.items()}
    return {"losses": losses, "norms": norms, "routers": routers, "last": dict(model.state_dict())}


def _train(case: str, layout: ParallelLayout, mesh: Any) -> dict[str, Any]:
    family, _, variant = case.partition("+")
    model = build(family)
    pipeline = CausalLMPipeline(model)
    e = layout.expert_parallel_size
    tp = layout.tensor_parallel_size
    options = RuntimeOptions(
        num_microbatches=2,
        tensor_parallel_plan=pipeline.tensor_parallel_plan(tp).plan if tp > 1 else None,
        timeout=timedelta(seconds=60),
        expert_parallel_size=e,
        expert_parallel_plan=pipeline.expert_parallel_plan(e),
        **VARIANTS[variant],
    )
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=LR))
    dp_rank, dp = mesh.coordinates.dp_rank, layout.data_parallel_size
    ep_rank = layout.ep_rank(mesh.rank)
    # Every expert parameter of this rank's layers holds the block of its ep_rank, 1/E of them.
    names = {id(p): n for n, p in model.named_parameters()}
    own = {names[id(p)]: p for layer in runtime.own_layers for p in layer.parameters()}
    blocks = {n: expert_shard(p) for n, p in own.items() if ".experts." in n}
    assert blocks and all(
        s is not None and s.local_experts == EXPERTS // e and s.first_expert == ep_rank * EXPERTS // e
        for s in blocks.values()
    ), blocks
    assert all(own[n].shape[0] == EXPERTS // e for n in blocks)
    assert all(expert_shard(p) is None for n, p in own.items() if n not in blocks)
    losses, norms, routers = [], [], {}
    for step, batch in enumerate(batches("padded", STEPS, BATCH)):
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        optimizer.zero_grad()
        recorded: dict[str, list[torch.Tensor]] = {}
        handles = _record_routers(model, recorded) if step == 0 else []
        runtime.begin_accumulation()
        result = runtime.train_batch(mine, _head)
        for h in handles:
            h.remove()
        norms.append(float(runtime.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        loss = torch.tensor([float(result.loss)], dtype=torch.float64)
        items = torch.tensor([float(pipeline.loss_items(mine).sum())], dtype=torch.float64)
        both = torch.cat([loss * items, items])
        dist.all_reduce(both, group=mesh.group(MeshAxis.DATA))
        losses.append(float(both[0] / both[1]))
        if step == 0:
            routers = {k: torch.cat(v) for k, v in recorded.items()}
    # Rank 0 assembles the whole model: each stage's tensors, the expert blocks by ep_rank, and
    # the routers' logits of the first step in the batch's order (data ranks in order).
    state = {n: p.detach() for n, p in own.items()}
    state |= {
        n: b.detach()
        for layer in runtime.own_layers
        for n, b in layer.named_buffers(prefix=_prefix(model, layer))
    }
    shared: list[Any] = [None] * dist.get_world_size()
    firsts = {n: s.first_expert for n, s in blocks.items() if s is not None}
    dist.all_gather_object(shared, (mesh.coordinates.dp_rank, state, routers, firsts))
    whole = gather_model_state(model, runtime.partition, mesh)  # tensor slices gathered whole
    runtime.close()
    if mesh.rank != 0:
        return {}
    last: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    whole_routers: dict[str, dict[int, torch.Tensor]] = {}
    for rank_dp, rank_state, rank_routers, rank_firsts in shared:
        for n, t in rank_state.items():
            if n in rank_firsts:
                pieces.setdefault(n, {})[rank_firsts[n]] = t
            else:
                last.setdefault(n, t)
        for n, t in rank_routers.items():
            whole_routers.setdefault(n, {})[rank_dp] = t
    last |= {n: t for n, t in whole.items() if n not in pieces}
    last |= {n: torch.cat([by_first[f] for f in sorted(by_first)]) for n, by_first in pieces.items()}
    routers = {n: torch.cat([by_dp[d] for d in sorted(by_dp)]) for n, by_dp in whole_routers.items()}
    expected = _reference(family)
    assert all(n > MAX_NORM for n in expected["norms"]), expected["norms"]  # clipping scaled every step
    assert sorted(last) == sorted(k for k in expected["last"] if k in last) and len(pieces) > 0
    missing = sorted(set(expected["last"]) - set(last) - {k for k in expected["last"] if "rotary" in k})
    assert missing == [], missing
    assert sorted(routers) == sorted(expected["routers"]), (sorted(routers), sorted(expected["routers"]))
    return {
        "losses": max(abs(a - b) for a, b in zip(losses, expected["losses"], strict=True)),
        "norms": max(abs(a - b) for a, b in zip(norms, expected["norms"], strict=True)),
        "router logits of the first step": max(
            (routers[k] - v).abs().max().item() for k, v in expected["routers"].items()
        ),
        "weights after the last step": max(
            (last[k] - v).abs().max().item() for k, v in expected["last"].items() if k in last
        ),
    }


def _prefix(model: nn.Module, layer: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is layer)


VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    # The all-to-all's backward inside the input-gradient pass, the weights' in the bubble.
    "zb": {"schedule": "zb_h1"},
    # The dispatch run again (counts exchanged again) in the backward of each recomputed layer.
    "recompute": {"recompute": "always"},
    # ZeRO-1: the experts' optimizer state over the expert-data group, the rest over the data axis.
    "zero1": {"shard_optimizer_state": True},
}
"""``family+variant``: the family trained with these options too."""


def _meta_built(mesh: Any) -> dict[str, Any]:
    """A mixtral built on the meta device: each rank materialises only its block of experts, and
    the blocks are the full experts' (as one process materialises them) cut by ``ep_rank``."""

    def meta() -> nn.Module:
        with torch.device("meta"):
            return build("mixtral")

    model = meta()
    pipeline = CausalLMPipeline(model)
    options = RuntimeOptions(expert_parallel_size=2, expert_parallel_plan=pipeline.expert_parallel_plan(2))
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, init=pipeline.init_weights
    )
    blocks = {n: p.detach().clone() for n, p in model.named_parameters() if expert_shard(p) is not None}
    shared: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shared, blocks)
    runtime.close()
    whole = meta()
    materialize(whole, torch.device("cpu"), 0, set(), CausalLMPipeline(whole).init_weights)
    expected = dict(whole.named_parameters())
    held = {n: t.shape[0] for n, t in blocks.items()}
    gap = max((torch.cat([h[n] for h in shared]) - expected[n]).abs().max().item() for n in blocks)
    return {"blocks": len(blocks), "held": sorted(set(held.values())), "gap": gap}


def experts_worker(sizes: tuple[int, int, int], families: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    layout = ParallelLayout(*sizes, expert_parallel_size=2)
    mesh = init_mesh(layout, "cpu")
    trained = {family: _train(family, layout, mesh) for family in families}
    if sizes == (2, 1, 1):
        trained["meta"] = _meta_built(mesh)
    return trained


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("sizes", "families"),
    [
        ((2, 1, 1), list(MOE_FAMILIES)),
        ((2, 2, 1), ["mixtral+zb", "deepseek_v3+recompute"]),
        # Experts whole inside each tensor group, each tensor rank dispatching in its expert group.
        ((2, 1, 2), ["mixtral", "qwen3_moe"]),
        # Eight processes: every axis at once (one tiny family), and with ZeRO-1.
        ((2, 2, 2), ["qwen3_moe", "qwen3_moe+zero1"]),
    ],
    ids=["ep2_dp2", "ep2_dp2_pp2", "ep2_dp2_tp2", "ep2_dp2_pp2_tp2"],
)
def test_moe_families_with_split_experts_train_like_their_own_forward(
    sizes: tuple[int, int, int], families: list[str]
) -> None:
    world = sizes[0] * sizes[1] * sizes[2]
    got = run_distributed(experts_worker, world, sizes, families, timeout=600, pg_timeout=120)[0]
    if "meta" in got:  # 8 expert tensors (2 per layer), 2 of 4 experts each, the full ones' blocks
        assert got.pop("meta") == {"blocks": 8, "held": [2], "gap": 0.0}
    failures = [
        f"{family}: {what} differ by {gap:.2e}"
        for family, gaps in got.items()
        for what, gap in gaps.items()
        if not gap <= 1e-9
    ]
    assert failures == [], "\n".join(failures)


# ------------------------------------------------------------------------------------ bad input
def _refusal(model: nn.Module, e: int) -> str:
    with pytest.raises(UnsupportedModelError) as caught:
        CausalLMPipeline(model).expert_parallel_plan(e)
    return str(caught.value)


def _mixtral(**changes: Any) -> nn.Module:
    model = build("mixtral")
    for key, value in changes.items():
        setattr(model.config, key, value)
    return model


def test_expert_sizes_that_do_not_divide_the_experts_are_refused_naming_the_layer() -> None:
    message = _refusal(build("mixtral"), 3)
    assert "expert_parallel_size=3 does not divide the 4 experts of model.layers.0.mlp.experts" in message
    assert "[1, 2, 4]" in message


def test_a_dense_model_is_refused() -> None:
    assert "ships no expert-parallel plan" in _refusal(build_dense("llama"), 2)
    # qwen3_moe with every layer dense: a plan, but no experts module to apply it to.
    name, model_class, overrides = MOE_FAMILIES["qwen3_moe"]
    config = getattr(transformers, name)(**{**COMMON, **overrides, "mlp_only_layers": [0, 1, 2, 3]})
    assert "has no mixture-of-experts layer" in _refusal(getattr(transformers, model_class)(config), 2)


def test_experts_that_cannot_be_dispatched_are_refused_naming_the_module_and_the_reason() -> None:
    model = build("mixtral")
    model.config.base_model_ep_plan = {"layers.*.mlp.experts": "ep_router"}
    assert "gives 'layers.*.mlp.experts' the style 'ep_router'" in _refusal(model, 2)


def test_options_a_dropless_dispatch_does_not_reproduce_are_refused() -> None:
    assert "router_jitter_noise=0.1" in _refusal(_mixtral(router_jitter_noise=0.1), 2)
    assert "moe_capacity_factor=1.25" in _refusal(_mixtral(moe_capacity_factor=1.25), 2)


def test_an_experts_module_with_a_parameter_the_plan_does_not_split_is_refused() -> None:
    model = build("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts.scale = nn.Parameter(torch.ones(3))
    plan = CausalLMPipeline(model).expert_parallel_plan(2)
    with pytest.raises(
        ExpertPlanError, match=r"model.layers.0.mlp.experts \(MixtralExperts\) holds parameters"
    ):
        shard_experts(model, plan, [model.model.layers[0]], None, 2, 0)  # type: ignore[arg-type]


def test_expert_parallelism_with_sequence_parallelism_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        ValueError, match="expert_parallel_size=2 cannot be combined with sequence_parallel=True"
    ) as e:
        RuntimeOptions(expert_parallel_size=2, sequence_parallel=True)
    assert "Use sequence_parallel=False" in str(e.value)
    # ZeRO-1 composes (tests/test_huggingface_expert_runs.py trains it); the layout log says where
    # the experts' state goes.
    options = RuntimeOptions(expert_parallel_size=2, shard_optimizer_state=True)
    assert describe_sharding(options, 4, None) == (
        "\n  optimizer state sharded over the 4 data-parallel replicas, the experts' over the 2 holding "
        "the same experts (ZeRO-1)"
    )


# ------------------------------------------------------------------------------------ Lightning
class ResumableStep(HuggingFaceStep):
    """mixtral with SGD and momentum (state a resume must bring back, the experts' blocks by global
    expert index), each batch's predicted tokens counted (a data rank's loss is its half's mean)."""

    def __init__(self) -> None:
        super().__init__("mixtral")
        self.items: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.items.append(float((batch["labels"][:, 1:] != -100).sum()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _fit(
    strategy: Any, devices: int, save: str | None = None, resume: str | None = None, epochs: int = 1
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """mixtral under Lightning for ``epochs`` (from ``resume``, a checkpoint, when given): each of
    ``devices`` data ranks takes its share of every batch of 8 rows (the shuffling sampler deals the
    same 8 rows per step to one or two ranks). The weights after the fit, expert blocks gathered by
    ``ep_rank`` (= ``dp_rank`` here), and each step's loss over the whole batch (the ranks' losses
    weighted by their tokens)."""
    torch.set_num_threads(1)
    model = ResumableStep()
    sampler = DistributedSampler(TRAIN, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    train = DataLoader(TRAIN, batch_size=BATCH // devices, sampler=sampler)
    trainer = fit(
        model, strategy, devices, train, ckpt_path=resume, max_epochs=epochs, num_sanity_val_steps=0
    )
    if save is not None:  # the strategy's checkpoint hooks, every rank (a collective)
        trainer.save_checkpoint(save)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = model.losses
    if devices > 1:
        blocks = {n: p for n, p in state.items() if expert_shard(model.get_parameter(n)) is not None}
        shared: list[Any] = [None] * devices
        dist.all_gather_object(shared, (blocks, model.losses, model.items))
        state |= {n: torch.cat([held[n] for held, _, _ in shared]) for n in blocks}
        losses = [
            sum(loss[k] * items[k] for _, loss, items in shared) / sum(items[k] for _, _, items in shared)
            for k in range(len(model.losses))
        ]
    return state, losses


def lightning_worker(save: str) -> list[tuple[dict[str, torch.Tensor], list[float]]]:
    """An epoch at dp=2 x E=2, saved by ``Trainer.save_checkpoint``; then a second Trainer's
    ``fit(ckpt_path=...)`` at E=2 resuming it for the second epoch, under ZeRO-1 (the checkpoint
    does not depend on the optimizer's sharding)."""

    def strategy(**options: Any) -> PipeTPStrategy:
        return PipeTPStrategy(
            pipeline_parallel_size=1,
            data_parallel_size=2,
            expert_parallel_size=2,
            num_microbatches=2,
            timeout=timedelta(seconds=60),
            **options,
        )

    first = _fit(strategy(), 2, save)
    return [first, _fit(strategy(shard_optimizer_state=True), 2, resume=save, epochs=2)]


@pytest.mark.distributed
def test_a_mixture_of_experts_fits_and_resumes_under_the_strategy_like_one_device(tmp_path: Path) -> None:
    """PipeTPStrategy(expert_parallel_size=2) on two data ranks, the plan derived from mixtral's
    own, in float32 (its grouped matrix products): the weights and losses of one device after an
    epoch, and after a second epoch resumed by another Trainer's ``fit(ckpt_path=...)`` at E=2
    under ZeRO-1 (the momentum of each expert block back by global expert index, cut into the
    ranks' slices), one device's uninterrupted two epochs."""
    ranks = run_distributed(lightning_worker, 2, str(tmp_path / "fit.ckpt"), timeout=300, init_group=False)
    expected, expected_losses = _fit("auto", 1)
    resumed_expected, resumed_losses = _fit("auto", 1, epochs=2)
    assert expected_losses == resumed_losses[:LIGHTNING_STEPS]
    # Trainer.save_checkpoint at E=2 (the strategy's hooks): every expert, in order, consolidated.
    saved = consolidate_checkpoint(tmp_path / "fit.ckpt", weights_only=True)["state_dict"]
    compared = [(f"rank {r}", ranks[r][0][0], expected) for r in range(2)] + [("saved", saved, expected)]
    compared += [(f"rank {r} resumed", ranks[r][1][0], resumed_expected) for r in range(2)]
    for what, state, reference in compared:
        assert state.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=f"{what}: {key}")
    for r in range(2):  # the first fit's three steps, then the resumed fit's three (a new module)
        first, second = ranks[r][0][1], ranks[r][1][1]
        assert len(first) == LIGHTNING_STEPS and len(second) == LIGHTNING_STEPS, (first, second)
        got = first + second
        gap = max(abs(a - b) for a, b in zip(got, resumed_losses, strict=True))
        assert gap <= 1e-5, (got, resumed_losses)
    start = dict(build_dense("mixtral").named_parameters())
    assert max((expected[f"model.{k}"] - v).abs().max().item() for k, v in start.items()) > 1e-3
    assert max((resumed_expected[k] - v).abs().max().item() for k, v in expected.items()) > 1e-3
