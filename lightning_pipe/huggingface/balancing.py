"""The router's load-balancing loss of a Hugging Face mixture of experts, carried along the pipeline.

With ``config.output_router_logits=True`` a MoE causal LM (mixtral, qwen2_moe, qwen3_moe, gpt_oss)
adds ``router_aux_loss_coef * aux`` to its loss, where ``aux`` is Hugging Face's
``load_balancing_loss_func`` of the router logits of *all* its layers (Switch Transformer's loss):
with ``p`` each token's softmax over the ``E`` experts and ``top_k(p)`` its ``k`` chosen ones,

* ``tokens_per_expert[e]`` = the number of (layer, token) pairs that chose ``e``, over the number
  of (layer, token) pairs (no gradient),
* ``router_prob_per_expert[e]`` = the sum of ``p[e]`` over (layer, token) pairs, over the same
  number (with gradient),

tokens weighted by the attention mask when one is given, and ``aux = E * sum(tokens_per_expert *
router_prob_per_expert)``. It is not a sum of per-layer losses: it couples layers that sit on
different pipeline stages. So each decoder layer's call adds its routers' *sums* (the top-k
counts, the probability sums, the masked token count) to three running totals that travel with
the hidden states as further tensors of the stage outputs (:class:`Sums`); the probability sums
require grad, so their gradient comes back through the pipeline's ordinary backward messages, to
every router. The head's call forms ``aux`` from the totals; the model's answer inside the step
(:class:`~lightning_pipe.huggingface.outputs.ModelCall`) adds ``coef * aux`` to the micro-batch's
loss and returns it as ``aux_loss``. The totals are summed in the model's layer order, starting
from zeros, with the very operations of ``load_balancing_loss_func``: with one micro-batch on one
data rank the loss and every gradient are the model's own, whatever the pipeline size.

With several micro-batches (or data ranks) ``aux`` is each micro-batch's own (as Megatron's
auxiliary loss is), and the runtime weights the micro-batches' losses, ``aux`` with them, by their
shares of the batch's tokens: see docs/huggingface.md, "The router's balancing loss".

The routers are the modules the model records its ``router_logits`` from
(``_can_record_outputs["router_logits"]``: the class and the output's index), hooked for the
duration of each decoder layer's call. That the family's causal LM computes exactly this loss with
these settings is checked once, at setup, on the rank holding ``lm_head``
(:func:`~lightning_pipe.huggingface.check.check_pipeline`): a family whose loss differs is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError

Sums = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""What travels beside the hidden states: per expert, the (masked) top-k counts (``[E]``, float32,
no gradient) and the (masked) probability sums (``[E]``, float32, with gradient), and the (masked)
number of (layer, token) rows (``[]``, float32)."""


@dataclass(frozen=True)
class BalancingLoss:
    """A family's router load-balancing loss: its settings and the routers it is computed from."""

    num_experts: int
    top_k: int
    coefficient: float
    """``router_aux_loss_coef``: the causal LM's loss is the language model's plus this times ``aux``."""
    router: type[nn.Module]
    """The class of the modules whose output (at :attr:`index`) are the router logits."""
    index: int

    @classmethod
    def of(cls, parts: CausalLMParts) -> BalancingLoss | None:
        """The model's balancing loss when ``config.output_router_logits`` asks for it and its
        causal LM adds one (``None`` otherwise: a family such as deepseek_v3 only returns the
        logits); refused when the model does not say where its routers are."""
        model: Any = parts.model
        name = f"{type(model).__name__} ({parts.family})"
        if not getattr(parts.config, "output_router_logits", False):
            return None
        if not hasattr(model, "router_aux_loss_coef"):
            return None  # no auxiliary loss in its forward (the setup check makes sure)
        recorders = getattr(parts.base, "_can_record_outputs", None) or {}
        spec = recorders.get("router_logits")
        router = getattr(spec, "target_class", None)
        if spec is None or not isinstance(router, type) or getattr(spec, "layer_name", None) is not None:
            raise UnsupportedModelError(
                f"{name} adds a router load-balancing loss (config.output_router_logits=True), but does not "
                "record its router logits from one module class (_can_record_outputs['router_logits']), so "
                "pipe_tp cannot find its routers on each stage. Set model.config.output_router_logits = "
                "False, or train without pipe_tp."
            )
        experts = getattr(model, "num_experts", None)
        top_k = getattr(model, "num_experts_per_tok", None)
        if not isinstance(experts, int) or not isinstance(top_k, int):
            raise UnsupportedModelError(
                f"{name} adds a router load-balancing loss (config.output_router_logits=True), but has no "
                "num_experts and num_experts_per_tok attributes as mixtral, qwen3_moe and gpt_oss do, so "
                "pipe_tp cannot reproduce its loss. Set model.config.output_router_logits = False, or train "
                "without pipe_tp."
            )
        return cls(experts, top_k, float(model.router_aux_loss_coef), router, int(spec.index))

    # ------------------------------------------------------------------ on each stage
    def start(self, like: torch.Tensor) -> Sums:
        """Zero totals, on the device of ``like`` (the first stage's input ids)."""
        zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=like.device)
        return zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=like.device)

    @contextlib.contextmanager
    def recording(self, layer: nn.Module) -> Iterator[list[torch.Tensor]]:
        """The router logits ``layer``'s routers give while the context is open, in call order."""
        seen: list[torch.Tensor] = []

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            logits = output[self.index] if isinstance(output, tuple | list) else output
            if logits is not None:
                seen.append(logits)

        handles = [m.register_forward_hook(hook) for m in layer.modules() if isinstance(m, self.router)]
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    def add(
        self, sums: Sequence[torch.Tensor], logits: Sequence[torch.Tensor], mask: torch.Tensor | None
    ) -> Sums:
        """``sums`` with the routers' ``logits`` (``[rows, E]`` each) added, masked by the ``[b, s]``
        padding ``mask`` (``None``: every row counts), as ``load_balancing_loss_func`` does."""
        counts, probabilities, rows = sums
        for layer_logits in logits:
            device = counts.device
            routing = torch.nn.functional.softmax(layer_logits.to(device), dim=-1)
            _, selected = torch.topk(routing, self.top_k, dim=-1)
            if mask is None:
                # histc as Hugging Face (floats on the CPU and MPS, integers on other devices).
                kind = torch.float32 if device.type in ("cpu", "mps") else torch.int32
                counts = counts + torch.histc(
                    selected.reshape(-1).to(kind), bins=self.num_experts, min=0, max=self.num_experts
                )
                probabilities = probabilities + routing.float().sum(dim=0)
                rows = rows + routing.shape[0]
            else:
                flat = mask.reshape(-1).to(device=device, dtype=torch.float32)
                if flat.shape[0] != routing.shape[0]:
                    raise ValueError(
                        f"A router gave {routing.shape[0]} rows of logits for a padding mask of "
                        f"{flat.shape[0]} tokens: pipe_tp computes the balancing loss on routers that see "
                        "every token of the micro-batch (sequence parallelism is not supported with it)."
                    )
                counts = counts + torch.zeros(
                    self.num_experts, dtype=torch.float32, device=device
                ).scatter_add_(0, selected.reshape(-1), flat.repeat_interleave(self.top_k))
                probabilities = probabilities + (routing.float() * flat.unsqueeze(-1)).sum(dim=0)
                rows = rows + flat.sum()
        return counts, probabilities, rows

    def loss(self, sums: Sequence[torch.Tensor]) -> torch.Tensor:
        """``aux`` from the totals of every layer (the end of ``load_balancing_loss_func``)."""
        counts, probabilities, rows = sums
        # A micro-batch of padding alone has no rows (and sums of zero): its aux is 0, not 0/0.
        rows = torch.where(rows > 0, rows, torch.ones_like(rows))
        tokens_per_expert = counts / rows
        router_prob_per_expert = probabilities / rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.num_experts

    def of_logits(self, logits: Sequence[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """``aux`` of all layers' router ``logits`` at once (what the setup check compares with the
        model's own)."""
        return self.loss(self.add(self.start(logits[0]), logits, mask))
