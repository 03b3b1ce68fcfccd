"""A Hugging Face mixture-of-experts causal LM's expert-parallel plan, from the model's own.

transformers 5.x ships ``config.base_model_ep_plan`` on its mixture-of-experts families:
``layers.*.mlp.experts: ep_dispatch_experts`` (the module holding every expert of a layer, called
with the router's top-k indices and weights) and ``layers.*.mlp.experts.gate_up_proj:
grouped_gemm`` (its weights, and gpt-oss's biases, stacked by expert). ``pipe_tp`` applies it with
:mod:`lightning_pipe.experts.apply`: each experts module keeps this rank's block of experts and
dispatches tokens to the ranks holding theirs; the router (``gate`` / ``router``), its top-k, its
normalisation and its weighting stay the family's own code, as do shared experts and dense layers
(DeepSeek-V3's ``first_k_dense_replace``: the plan matches no ``experts`` module there).

Refused here, before any work, with the reason: a family with no expert-parallel plan, a plan
entry of another style, a model whose plan matches no module (no mixture-of-experts layer), an
expert count the expert size does not divide, and options under which the family's own forward
is not what a dropless dispatch computes (a capacity that drops tokens, router jitter noise).
"""

from __future__ import annotations

import re
from typing import Any

from lightning_pipe.experts.apply import ExpertPlanError, check_expert_counts
from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError
from lightning_pipe.tensor_parallel.plan import pattern_regex

STYLES = ("ep_dispatch_experts", "grouped_gemm")
"""The styles of Hugging Face's expert-parallel plans that ``pipe_tp`` implements."""

_CAPACITY = re.compile(r"capacity|drop_tokens|token_drop")
"""Config attributes that make a family drop tokens past an expert's capacity."""


def expert_plan(parts: CausalLMParts, prefix: str, expert_parallel_size: int) -> dict[str, str]:
    """The model's ``base_model_ep_plan`` as names inside the module trained (``prefix`` + the
    causal LM's names), checked for ``expert_parallel_size`` (see the module docstring)."""
    model, config = parts.model, parts.config
    where = f"{parts.family} ({type(model).__name__})"
    plan: Any = getattr(config, "base_model_ep_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise UnsupportedModelError(
            f"expert_parallel_size={expert_parallel_size}, but {where} ships no expert-parallel plan "
            "(config.base_model_ep_plan is empty), so pipe_tp cannot tell which modules are its experts. "
            "Use expert_parallel_size=1."
        )
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UnsupportedModelError(
                f"{where}: its expert-parallel plan gives {pattern!r} the style {style!r}, which pipe_tp "
                f"cannot dispatch (it implements {list(STYLES)}). Use expert_parallel_size=1."
            )
    names = {n: m for n, m in model.named_modules() if n}
    base = parts.base_name
    dispatched = [
        n
        for p, s in plan.items()
        if s == "ep_dispatch_experts"
        for n in names
        if pattern_regex(f"{base}.{p}").fullmatch(n)
    ]
    if not dispatched:
        raise UnsupportedModelError(
            f"expert_parallel_size={expert_parallel_size}, but {where} has no mixture-of-experts layer "
            f"(its expert-parallel plan matches no module). Use expert_parallel_size=1 for it."
        )
    try:  # the one check of the expert counts, shared with plans given by hand
        check_expert_counts(model, {f"{base}.{p}": str(st) for p, st in plan.items()}, expert_parallel_size)
    except ExpertPlanError as err:
        raise UnsupportedModelError(f"{where}: {err}") from None
    _refuse_dropping(config, where)
    return {f"{prefix}{base}.{p}": str(s) for p, s in plan.items()}


def _refuse_dropping(config: Any, where: str) -> None:
    """Options under which the family's experts do not see every routed token, or see it changed
    by a random draw per rank: a dropless dispatch would train another model."""
    for key, value in sorted(config.to_dict().items()):
        if _CAPACITY.search(key) and value not in (None, 0, 0.0, False, -1):
            raise UnsupportedModelError(
                f"{where} sets {key}={value!r} (experts drop tokens past a capacity), which pipe_tp's "
                "dropless expert dispatch does not reproduce; unset it, or use expert_parallel_size=1."
            )
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise UnsupportedModelError(
            f"{where} sets router_jitter_noise={jitter} (each rank would draw its own noise on its "
            "tokens before routing, unlike one device's draw over the whole batch); set "
            "router_jitter_noise=0.0, or use expert_parallel_size=1."
        )
