"""The router's load-balancing loss of Hugging Face mixtures of experts (``output_router_logits=True``)
under ``pipe_tp``: carried along the pipeline as the routers' sums, it equals the model's own loss
and gradients on one process and at pp=2 with one micro-batch, each micro-batch's own (weighted by
its tokens) with several micro-batches or data ranks (with the experts split over them too), is not
counted twice under tensor parallelism, balances the experts when trained, and what cannot be
reproduced is refused.

Families: mixtral (float32: its grouped expert products have no float64 kernel), qwen3_moe with a
dense layer, gpt_oss (router biases, eager attention) and deepseek_v3 (whose causal LM adds no
auxiliary loss: accepted, nothing added), the last three in float64 with eager experts.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from lightning_pipe.huggingface import CausalLMPipeline, ModelCall, ModelCallError, UnsupportedModelError
from lightning_pipe.huggingface.outputs import causal_lm_loss
from tests.hf_families import COMMON, padded_batch

FAMILIES: dict[str, tuple[str, str, dict[str, Any], torch.dtype]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
        torch.float32,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]),
        torch.float64,
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        torch.float64,
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=16,
            kv_lora_rank=8,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_shared_experts=1,
            num_key_value_heads=4,
            rope_interleave=False,
        ),
        torch.float64,
    ),
}


def build_moe(
    family: str, seed: int = 0, coefficient: float | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The family's tiny MoE causal LM with ``output_router_logits=True``, equal in every process."""
    config_name, model_name, overrides, own_dtype = FAMILIES[family]
    dtype = dtype or own_dtype
    made = getattr(transformers, config_name)(**{**COMMON, **overrides})
    made._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    if dtype == torch.float64:
        made._experts_implementation = "eager"  # the grouped products have no float64 kernel
    made.use_cache = False
    made.output_router_logits = True
    if coefficient is not None:
        made.router_aux_loss_coef = coefficient
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(made)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model.to(dtype).train()


def tolerance(family: str) -> float:
    return 1e-9 if FAMILIES[family][3] == torch.float64 else 1e-5


def own_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own forward on ``batch``: its language-model loss in the model's precision
    (Hugging Face's casts to float32) plus ``router_aux_loss_coef`` times its ``aux_loss``."""
    out = model(**batch)
    aux = getattr(out, "aux_loss", None)
    loss = causal_lm_loss(out.logits, batch["labels"])
    if aux is not None:
        loss = loss + model.router_aux_loss_coef * aux
    return loss, aux


def pipelined_loss(pipeline: CausalLMPipeline, batch: dict[str, torch.Tensor]) -> Any:
    """The derived layer calls chained on one process, answered as the last stage answers the step."""
    x: Any = pipeline.pipeline_input(batch)
    for layer, call in zip(pipeline.layers(), pipeline.calls(), strict=True):
        x = call(layer, x)
    items = float(pipeline.loss_items(batch).sum())
    return ModelCall(pipeline, batch, x, items, counted_labels=True)(**batch)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_process_loss_and_gradients_are_the_models_own(family: str) -> None:
    model = build_moe(family)
    pipeline = CausalLMPipeline(model)
    assert (pipeline.balancing is None) == (family == "deepseek_v3")
    batch = padded_batch(4, seed=1)
    theirs, aux = own_loss(model, batch)
    theirs.backward()
    expected = _grads(model)
    model.zero_grad()
    answer = pipelined_loss(pipeline, batch)
    answer.loss.backward()
    got = _grads(model)
    tol = tolerance(family)
    assert abs(float(answer.loss.detach()) - float(theirs.detach())) <= tol
    assert sorted(got) == sorted(expected)
    gap = max((got[k] - v).abs().max().item() for k, v in expected.items())
    assert gap <= tol, gap
    if aux is not None:  # every router is trained by the auxiliary loss, and it is returned
        assert abs(float(answer.aux_loss.detach()) - float(aux.detach())) <= tol
        assert any("gate" in k or "router" in k for k in got)
    assert pipeline.check(pipeline.pipeline_input(batch), pipeline.layers()) == (None, None)


@pytest.fixture
def one_thread() -> Any:
    """One intra-op thread: the two-core machine runs other tests beside (2 threads are 3x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_balancing_loss_balances_the_experts(one_thread: None) -> None:
    """A tiny gpt_oss whose routers start out preferring expert 0 (its router has a bias: one
    number makes the start unbalanced), trained 15 steps on the same data with and without the
    balancing loss (one process, the derived pipeline, float32): the tokens each expert receives,
    counted by a hook on the routers over held-out batches, are far closer to uniform with it."""

    def spread(coefficient: float) -> float:
        model = build_moe("gpt_oss", coefficient=coefficient, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.router.bias"):
                    param[0] += 2.0
        pipeline = CausalLMPipeline(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(15):
            optimizer.zero_grad()
            pipelined_loss(pipeline, padded_batch(4, seed=200 + step)).loss.backward()
            optimizer.step()
        counts = torch.zeros(4)

        def count(module: nn.Module, args: Any, output: Any) -> None:
            counts.add_(torch.bincount(output[2].reshape(-1), minlength=4).float())

        hooks = [m.register_forward_hook(count) for n, m in model.named_modules() if n.endswith("mlp.router")]
        with torch.no_grad():
            for seed in range(2):
                model(**padded_batch(8, seed=900 + seed))
        for hook in hooks:
            hook.remove()
        return float(counts.std() / counts.mean())  # the coefficient of variation

    without, with_loss = spread(0.0), spread(1.0)
    assert without > 0.5, without  # still unbalanced when the language model's loss alone trains
    assert with_loss < 0.4 * without, (with_loss, without)


# --------------------------------------------------------------------------- bad input
def test_a_family_whose_loss_differs_is_refused_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_moe("mixtral")
    pipeline = CausalLMPipeline(model)
    module = sys.modules[type(model).__module__]
    own = module.load_balancing_loss_func
    monkeypatch.setattr(module, "load_balancing_loss_func", lambda *args: own(*args) * 2)
    error, _ = pipeline.check(pipeline.pipeline_input(padded_batch(2, seed=1)), pipeline.layers())
    assert error is not None and "load-balancing loss differs from Hugging Face's" in error
    assert "output_router_logits = False" in error


def test_a_loss_added_otherwise_is_refused_at_setup() -> None:
    model = build_moe("mixtral")
    pipeline = CausalLMPipeline(model)
    model.router_aux_loss_coef = 0.5  # the loss adds another coefficient than the one pipe_tp read
    error, _ = pipeline.check(pipeline.pipeline_input(padded_batch(2, seed=1)), pipeline.layers())
    assert error is not None and "router_aux_loss_coef (0.001)" in error


def test_a_family_that_hides_its_routers_is_refused() -> None:
    model = build_moe("mixtral")
    model.model._can_record_outputs = {}
    with pytest.raises(UnsupportedModelError, match=r"router logits .*output_router_logits = False"):
        CausalLMPipeline(model)


def test_sequence_parallelism_with_the_balancing_loss_is_refused() -> None:
    pipeline = CausalLMPipeline(build_moe("mixtral"))
    with pytest.raises(UnsupportedModelError, match=r"under sequence parallelism .* sequence_parallel off"):
        pipeline.tensor_parallel_plan(2, sequence_parallel=True)
    # With a plan given as an option (no plan derived): the sequence check stops every rank.
    error = pipeline.check_sequence(pipeline.pipeline_input(padded_batch(2, seed=1)), pipeline.layers(), None)  # type: ignore[arg-type]
    assert error is not None and "under sequence parallelism" in error


def test_asking_for_the_loss_the_pipeline_did_not_carry() -> None:
    model = build_moe("mixtral")
    model.config.output_router_logits = False
    pipeline = CausalLMPipeline(model)
    batch = padded_batch(2, seed=1)
    x: Any = pipeline.pipeline_input(batch)
    for layer, call in zip(pipeline.layers(), pipeline.calls(), strict=True):
        x = call(layer, x)
    call = ModelCall(pipeline, batch, x, float(pipeline.loss_items(batch).sum()), counted_labels=True)
    with pytest.raises(ModelCallError, match=r"config has output_router_logits=False"):
        call(**batch, output_router_logits=True)


def test_turned_off_in_the_call_the_loss_is_the_language_models() -> None:
    model = build_moe("mixtral")
    pipeline = CausalLMPipeline(model)
    batch = padded_batch(2, seed=1)
    answer = pipelined_loss(pipeline, batch)
    x: Any = pipeline.pipeline_input(batch)
    for layer, call in zip(pipeline.layers(), pipeline.calls(), strict=True):
        x = call(layer, x)
    plain = ModelCall(pipeline, batch, x, float(pipeline.loss_items(batch).sum()), counted_labels=True)(
        **batch, output_router_logits=False
    )
    theirs = model(**batch, output_router_logits=False)
    assert getattr(plain, "aux_loss", None) is None
    assert abs(float(plain.loss.detach()) - float(theirs.loss.detach())) <= 1e-5
    assert float(answer.loss.detach()) > float(plain.loss.detach())


# --------------------------------------------------------------------------- several processes
BATCH = 4
LAYOUTS = {"pp2": (1, 2, 1), "tp2": (1, 1, 2), "dp2": (2, 1, 1)}
ZERO_BUBBLE = {"schedule": "zb_h1", "recompute": "always"}
CASES: list[tuple[str, int, str, dict[str, Any]]] = [
    ("pp2", 1, "mixtral", {}),
    ("pp2", 1, "qwen3_moe", {}),
    ("pp2", 1, "gpt_oss", {}),
    ("pp2", 1, "deepseek_v3", {}),
    ("pp2", 2, "mixtral", {}),
    ("pp2", 2, "gpt_oss", ZERO_BUBBLE),
    ("pp2", 2, "qwen3_moe", {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("tp2", 1, "mixtral", {}),
    ("dp2", 1, "gpt_oss", {}),
    ("dp2", 1, "mixtral", {"shard_parameters": True}),
]
"""(layout, micro-batches, family, options): pp=2 with one micro-batch is the model's own loss;
two micro-batches (1F1B; the zero-bubble split with recomputation; interleaved stages, the sums
crossing the ranks twice) or two data ranks (replicated; FSDP2) give each part's own auxiliary
loss, weighted by its tokens; tp=2 counts it once."""


def reference(family: str, batch: dict[str, torch.Tensor], parts: int) -> dict[str, Any]:
    """The documented definition on one process: the batch cut in ``parts`` (micro-batches, or
    data ranks' shares), each part's own loss (language model + coefficient x its own aux) weighted
    by its share of the batch's target tokens; its value and gradients."""
    model = build_moe(family)
    pieces = [{k: v.chunk(parts)[i] for k, v in batch.items()} for i in range(parts)]
    items = [float((p["labels"][:, 1:] != -100).sum()) for p in pieces]
    loss = sum(own_loss(model, p)[0] * (n / sum(items)) for p, n in zip(pieces, items, strict=True))
    loss.backward()  # type: ignore[union-attr]
    return {"loss": float(loss.detach()), "grads": _grads(model)}  # type: ignore[union-attr]


def balancing_worker() -> dict[str, Any]:
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
    from lightning_pipe.runtime.batch import Microbatch
    from tests.test_huggingface_families import _gathered_grads

    torch.set_num_threads(1)
    meshes = {name: init_mesh(ParallelLayout(*sizes), "cpu") for name, sizes in LAYOUTS.items()}
    batch = padded_batch(BATCH, seed=7)
    out: dict[str, Any] = {}
    for layout, microbatches, family, extra in CASES:
        mesh = meshes[layout]
        model = build_moe(family)
        pipeline = CausalLMPipeline(model)
        sizes = LAYOUTS[layout]
        plan = pipeline.tensor_parallel_plan(sizes[2]).plan if sizes[2] > 1 else None
        options = RuntimeOptions(
            num_microbatches=microbatches, tensor_parallel_plan=plan, timeout=timedelta(seconds=60), **extra
        )
        runtime = ParallelRuntime(
            model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
        )
        auxes: list[float] = []

        def head(
            output: Any,
            microbatch: Microbatch,
            pipeline: CausalLMPipeline = pipeline,
            auxes: list[float] = auxes,
        ) -> torch.Tensor:
            data = microbatch.data
            answer = ModelCall(pipeline, data, output, microbatch.items, counted_labels=True)(**data)
            aux = getattr(answer, "aux_loss", None)
            auxes.append(float(aux.detach()) if aux is not None else float("nan"))
            return answer.loss

        dp, dp_rank = sizes[0], mesh.coordinates.dp_rank
        runtime.begin_accumulation()
        result = runtime.train_batch({k: v.chunk(dp)[dp_rank] for k, v in batch.items()}, head)
        grads = _gathered_grads(model, runtime)
        runtime.close()
        case = f"{layout}/{microbatches}/{family}"
        case += "/" + ",".join(f"{k}={v}" for k, v in extra.items())
        out[case] = {"loss": float(result.loss), "auxes": auxes}  # each rank's step saw its own
        if mesh.rank == 0:
            out[case]["grads"] = grads
    out["experts"] = _split_experts_steps()
    return out


EXPERT_FAMILY, EXPERT_STEPS, EXPERT_LR = "qwen3_moe", 3, 0.5


def _expert_batches() -> list[dict[str, torch.Tensor]]:
    return [padded_batch(BATCH, seed=20 + step) for step in range(EXPERT_STEPS)]


def _split_experts_steps() -> dict[str, Any]:
    """qwen3_moe (a dense layer among them) at dp=2 with its experts split (E=2), one micro-batch,
    SGD: each step's loss and ``aux_loss`` as the step's answer gives them (what
    ``CausalLMModule`` logs), and the whole model after the steps."""
    from lightning_pipe.checkpoint.full import gather_model_state
    from lightning_pipe.mesh import ParallelLayout, init_mesh
    from lightning_pipe.runtime import ParallelRuntime, RuntimeOptions
    from lightning_pipe.runtime.batch import Microbatch

    mesh = init_mesh(ParallelLayout(2, 1, 1, expert_parallel_size=2), "cpu")
    model = build_moe(EXPERT_FAMILY)
    pipeline = CausalLMPipeline(model)
    options = RuntimeOptions(
        num_microbatches=1,
        timeout=timedelta(seconds=60),
        expert_parallel_size=2,
        expert_parallel_plan=pipeline.expert_parallel_plan(2),
    )
    runtime = ParallelRuntime(
        model, pipeline.layers(), mesh, torch.device("cpu"), options, seed=0, hooks=pipeline.hooks()
    )
    optimizer = runtime.keep_own(torch.optim.SGD(model.parameters(), lr=EXPERT_LR))
    auxes: list[float] = []

    def head(output: Any, microbatch: Microbatch) -> torch.Tensor:
        data = microbatch.data
        answer = ModelCall(pipeline, data, output, microbatch.items, counted_labels=True)(**data)
        auxes.append(float(answer.aux_loss.detach()))
        return answer.loss

    losses = []
    dp_rank = mesh.coordinates.dp_rank
    for batch in _expert_batches():
        optimizer.zero_grad()
        runtime.begin_accumulation()
        result = runtime.train_batch({k: v.chunk(2)[dp_rank] for k, v in batch.items()}, head)
        optimizer.step()
        losses.append(float(result.loss))
    weights = gather_model_state(model, runtime.partition, mesh)
    runtime.close()
    return {"losses": losses, "auxes": auxes, "weights": weights if mesh.rank == 0 else {}}


def _split_experts_reference() -> dict[str, Any]:
    """One process: the model's own forward on each data rank's half (its loss and its
    ``aux_loss``), the halves' losses weighted by their tokens, SGD; the weights after the steps."""
    model = build_moe(EXPERT_FAMILY)
    optimizer = torch.optim.SGD(model.parameters(), lr=EXPERT_LR)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    losses: list[list[float]] = [[], []]
    auxes: list[list[float]] = [[], []]
    for batch in _expert_batches():
        halves = [{k: v.chunk(2)[i] for k, v in batch.items()} for i in range(2)]
        items = [float((h["labels"][:, 1:] != -100).sum()) for h in halves]
        optimizer.zero_grad()
        total: Any = 0.0
        for rank, (half, n) in enumerate(zip(halves, items, strict=True)):
            loss, aux = own_loss(model, half)
            assert aux is not None
            losses[rank].append(float(loss.detach()))
            auxes[rank].append(float(aux.detach()))
            total = total + loss * (n / sum(items))
        total.backward()
        optimizer.step()
    return {"losses": losses, "auxes": auxes, "weights": dict(model.state_dict()), "start": start}


@pytest.mark.distributed
def test_pipelined_balancing_loss_is_the_models_own_or_per_microbatch() -> None:
    from tests.distributed import run_distributed

    ranks = run_distributed(balancing_worker, 2, timeout=600, pg_timeout=120)
    got = ranks[0]
    batch = padded_batch(BATCH, seed=7)
    failures = _split_experts_failures(ranks)
    for layout, microbatches, family, extra in CASES:
        case = f"{layout}/{microbatches}/{family}/" + ",".join(f"{k}={v}" for k, v in extra.items())
        parts = microbatches * LAYOUTS[layout][0]
        expected = reference(family, batch, parts)
        result, tol = got[case], tolerance(family)
        if layout != "dp2":  # a data rank reports its own loss
            if abs(result["loss"] - expected["loss"]) > tol:
                failures.append(f"{case}: loss {result['loss']} != {expected['loss']}")
        gap = max((result["grads"][k] - v).abs().max().item() for k, v in expected["grads"].items())
        if gap > tol:
            failures.append(f"{case}: gradients differ by {gap:.2e} > {tol:.0e}")
        # The steps on the last stage (every rank of tp2 and dp2) saw one aux per micro-batch.
        auxes = [a for rank in ranks for a in rank[case]["auxes"]]
        steps = microbatches * (1 if layout == "pp2" else 2)
        if len(auxes) != steps or (family != "deepseek_v3") != all(a > 0 for a in auxes):
            failures.append(f"{case}: the steps saw the auxiliary losses {auxes}")
    assert failures == [], "\n".join(failures)


def _split_experts_failures(ranks: list[dict[str, Any]]) -> list[str]:
    """With the experts split (dp=2 x E=2, one micro-batch) each data rank's loss and logged
    ``aux_loss`` are the model's own on its half, and the weights after the steps one process's
    (float64, 1e-9)."""
    expected = _split_experts_reference()
    failures = []
    for rank, got in enumerate(r["experts"] for r in ranks):
        for what in ("losses", "auxes"):
            gap = max(abs(a - b) for a, b in zip(got[what], expected[what][rank], strict=True))
            if not gap <= 1e-9:
                failures.append(f"E=2, rank {rank}: {what} {got[what]} != {expected[what][rank]}")
    weights = ranks[0]["experts"]["weights"]
    assert sorted(weights) == sorted(k for k in expected["weights"] if "rotary" not in k)
    gap = max((weights[k] - v).abs().max().item() for k, v in expected["weights"].items() if k in weights)
    if not gap <= 1e-9:
        failures.append(f"E=2: weights after {EXPERT_STEPS} steps differ by {gap:.2e}")
    moved = max((expected["weights"][k] - v).abs().max().item() for k, v in expected["start"].items())
    assert moved > 1e-4 and all(a > 1.0 for r in expected["auxes"] for a in r), expected["auxes"]
    return failures


def lightning_worker() -> dict[str, float]:
    from lightning_pipe import CausalLMModule, PipeTPStrategy
    from tests.hf_families import batches
    from tests.trainers import fit

    torch.set_num_threads(1)
    config = dict(model_type="mixtral", **COMMON, num_local_experts=4, num_experts_per_tok=2)
    module = CausalLMModule({**config, "output_router_logits": True, "router_aux_loss_coef": 0.02}, lr=1e-2)
    data = [{k: v[i] for k, v in b.items()} for b in batches("padded", 2, BATCH) for i in range(BATCH)]
    strategy = PipeTPStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    trainer = fit(module, strategy, 2, loader, val=loader, max_epochs=1, limit_val_batches=1)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.distributed
def test_causal_lm_module_logs_the_balancing_loss_apart() -> None:
    """Under pipe_tp (pp=2, two micro-batches) CausalLMModule logs the balancing loss and the
    language model's loss beside the loss, on every rank."""
    from tests.distributed import run_distributed

    for metrics in run_distributed(lightning_worker, 2, timeout=300, init_group=False):
        for stage in ("train", "val"):
            loss, aux, lm = (metrics[f"{stage}_{k}"] for k in ("loss", "aux_loss", "lm_loss"))
            assert aux > 0.5 and lm > 1.0, metrics  # Switch's loss is at least 1 (k=2: 2)
            assert abs(loss - (lm + 0.02 * aux)) <= 1e-5, metrics
