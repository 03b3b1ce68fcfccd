"""A Hugging Face causal LM as a ``pipe_tp`` pipeline, with no wrappers written by the user.

The pipeline layers are the model's own modules, in its plan's order (see
:mod:`~lightning_pipe.huggingface.parts`): the embedding, each decoder layer, the final norm and
``lm_head``. They keep their names, so the partition, checkpoints, pretrained files and the
tensor-parallel plan all speak Hugging Face's names. How each is called is a
:data:`~lightning_pipe.execution.layers.LayerCall`: what travels between layers is the tuple
``(hidden_states, attention_mask, position_ids)`` (the mask ``[b, 0]`` for none), each decoder
layer's call rebuilds its mask and rotary table (:mod:`~lightning_pipe.huggingface.context`), and
``lm_head``'s call applies the family's logit epilogue and returns the logits alone.

A batch is what Hugging Face's collators give (a dict with ``input_ids`` and optionally
``attention_mask``, ``position_ids`` and ``labels``), or a tensor of input ids, or a tuple whose
first element is one; under Lightning any other structure too, whose tensors the strategy finds
by running the step once (:mod:`~lightning_pipe.huggingface.batch_roles`: :attr:`step_inputs`
turns a batch into such a dict). With ``labels`` (or ``shift_labels``) in the batch, micro-batch
losses are weighted by their share of the batch's predicted tokens (``labels[:, 1:] != -100``,
the tokens Hugging Face's causal-LM loss averages over), so that the loss and gradients are the
whole batch's mean, not a mean of micro-batch means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.layers import LayerCall
from lightning_pipe.huggingface.balancing import BalancingLoss
from lightning_pipe.huggingface.batch_roles import StepInputs
from lightning_pipe.huggingface.check import check_pipeline
from lightning_pipe.huggingface.context import (
    IGNORE_INDEX,
    Epilogue,
    LayerContext,
    Prologue,
    default_positions,
    mask_or_none,
    no_mask,
)
from lightning_pipe.huggingface.context_cut import cut_batch, layer_shard
from lightning_pipe.huggingface.experts import expert_plan
from lightning_pipe.huggingface.parts import CausalLMParts, UnsupportedModelError, causal_lm_parts
from lightning_pipe.huggingface.sequence_check import check_sequence_split
from lightning_pipe.huggingface.tensor_parallel import DerivedPlan, derive_plan
from lightning_pipe.runtime.hooks import ModelHooks
from lightning_pipe.tensor_parallel.cross_entropy import copy_vocab_parallel_tag
from lightning_pipe.tensor_parallel.layers import VocabParallelEmbedding


class CausalLMPipeline:
    """The pipeline of the Hugging Face causal LM ``model`` (a submodule of the module trained).

    Args:
        model: a ``...ForCausalLM`` whose config has a ``base_model_pp_plan``.
        name: the model's qualified name inside the module trained (``"model"`` for a
            LightningModule's ``self.model``; ``""`` when it is the module itself): the prefix of
            its tensor-parallel plan and of its keys in checkpoints.
    """

    def __init__(self, model: nn.Module, name: str = "") -> None:
        self.parts: CausalLMParts = causal_lm_parts(model)
        self.model = model
        self.name = name
        self.context = LayerContext(self.parts)
        self.prologue = Prologue.of(self.parts)
        self.epilogue = Epilogue.of(self.parts)
        self.balancing = BalancingLoss.of(self.parts)
        """The router's load-balancing loss the model adds (``config.output_router_logits``), whose
        running sums travel after the position ids (:mod:`~lightning_pipe.huggingface.balancing`);
        ``None`` when it adds none."""
        self.step_inputs = StepInputs()
        """Which of a batch's tensors the step gives the model, learned from the step (set by the
        strategy before each step; nothing learned: the batch as it is)."""
        self.scatter_after_embedding = False
        """Set by :meth:`tensor_parallel_plan` under sequence parallelism when the embedding is
        vocab-parallel: the embedding call then splits the hidden states along the sequence."""

    @property
    def family(self) -> str:
        return self.parts.family

    @property
    def prefix(self) -> str:
        """What the module trained puts before the model's own names (``"model."``)."""
        return f"{self.name}." if self.name else ""

    # ------------------------------------------------------------------ layers
    def layers(self) -> list[nn.Module]:
        """The pipeline layers: the model's own modules, in order."""
        return [self.model.get_submodule(n) for n in self.parts.names()]

    def calls(self) -> list[LayerCall]:
        """How each layer is called (see the module docstring)."""
        parts = self.parts
        calls: list[LayerCall] = []
        for position in range(len(parts.before)):
            calls.append(self._embed if position == 0 else _hidden_only)
        calls += [self.decoder_call(i) for i in range(parts.num_layers)]
        calls += [_hidden_only] * len(parts.after)
        calls.append(self._head)
        return calls

    def _embed(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, mask, positions = args
        # Under sequence parallelism after a vocab-parallel embedding: the embedding sums the
        # ranks' rows and keeps this rank's part of the sequence at once (a reduce-scatter, not an
        # all-reduce and a split); the family's prologue, a multiplier, applies to the part as to
        # the whole. The mask and positions stay whole: every layer's attention sees the whole
        # sequence. (Before the layer is sliced, e.g. when timing layers, nothing is split.)
        if self.scatter_after_embedding and isinstance(layer, VocabParallelEmbedding):
            layer.sequence_output = True
        sums = self.balancing.start(input_ids) if self.balancing is not None else ()
        return self.prologue(layer(input_ids)), mask, positions, *sums

    def decoder_call(self, index: int) -> LayerCall:
        """How decoder layer ``index`` is called: its hidden states, and the masks, position ids
        and rotary table rebuilt for it (:class:`LayerContext`)."""
        context, balancing = self.context, self.balancing

        def call(layer: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
            hidden, mask, positions, *sums = args
            kwargs = context(index, hidden, mask, positions)
            if balancing is None:
                with layer_shard(mask, positions):  # context parallelism: the ring's key mask
                    out = layer(hidden, **kwargs)
                return (out[0] if isinstance(out, tuple) else out), mask, positions
            if hidden.shape[1] != positions.shape[-1]:  # this rank's part of the sequence
                raise UnsupportedModelError(self._no_sequence_parallel())
            with balancing.recording(layer) as logits, layer_shard(mask, positions):
                out = layer(hidden, **kwargs)
            sums = list(balancing.add(sums, logits, mask_or_none(mask)))
            return (out[0] if isinstance(out, tuple) else out), mask, positions, *sums

        return call

    def _head(self, layer: nn.Module, args: tuple[Any, ...]) -> Any:
        """The logits; with a balancing loss, ``(logits, aux)`` (formed from the carried sums)."""
        logits = layer(args[0])
        logits = copy_vocab_parallel_tag(self.epilogue(logits), logits)
        if self.balancing is None:
            return logits
        return logits, self.balancing.loss(args[3:])

    # ------------------------------------------------------------------ batches
    def pipeline_input(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, position_ids)`` of a (micro-)batch, as the first layer
        takes them (the mask ``[b, 0]`` when the batch has none, positions ``arange`` when none)."""
        input_ids, mask, positions = model_inputs(batch)
        if positions is not None and getattr(self.parts.config, "use_cache", False):
            self._refuse_packed_with_cache(positions)
        return (
            input_ids,
            no_mask(input_ids) if mask is None else mask,
            default_positions(input_ids) if positions is None else positions,
        )

    def _refuse_packed_with_cache(self, positions: torch.Tensor) -> None:
        """With ``config.use_cache=True`` Hugging Face's forward builds a cache and then ignores
        the boundaries of packed sequences (position ids restarting at 0): one device attends
        across them, which the pipeline, masking each sequence apart, would not reproduce."""
        steps = positions[..., 1:] - positions[..., :-1]
        if bool((steps != 1).any()):
            raise ValueError(
                f"{type(self.model).__name__} has config.use_cache=True and the batch packs several "
                "sequences per row (position_ids restart): with a cache Hugging Face's forward attends "
                "across the packed sequences' boundaries, which pipe_tp does not reproduce. Training "
                f"needs no cache: set model.config.use_cache = False (e.g. in configure_model)."
            )

    def loss_items(self, batch: Any) -> torch.Tensor | None:
        """Per sample, the tokens Hugging Face's causal-LM loss averages over (``labels`` shifted
        by one, or ``shift_labels``; ``-100`` ignored); ``None`` for a batch without either
        (weighted by samples)."""
        if not isinstance(batch, Mapping):
            return None
        shifted = batch.get("shift_labels")  # already aligned with the logits: no shift
        if isinstance(shifted, torch.Tensor):
            return (shifted != IGNORE_INDEX).sum(dim=-1)
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            return None
        return (labels[:, 1:] != IGNORE_INDEX).sum(dim=-1)

    # ------------------------------------------------------------------ the rest
    def tensor_parallel_plan(self, tensor_parallel_size: int, sequence_parallel: bool = False) -> DerivedPlan:
        """The model's own plan, as names inside the module trained, and what it leaves whole
        (see :mod:`lightning_pipe.huggingface.tensor_parallel`); with ``sequence_parallel``, also
        where the sequence is split and gathered. Call it before :meth:`hooks`: whether the
        embedding call splits the sequence is decided here."""
        if sequence_parallel and self.balancing is not None:
            raise UnsupportedModelError(self._no_sequence_parallel())
        derived = derive_plan(self.parts, self.prefix, tensor_parallel_size, sequence_parallel)
        self.scatter_after_embedding = derived.scatter_after_embedding
        return derived

    def _no_sequence_parallel(self) -> str:
        return (
            f"{type(self.model).__name__} ({self.family}) adds a router load-balancing loss "
            "(config.output_router_logits=True), which pipe_tp does not compute under sequence parallelism "
            "(each tensor rank's routers see part of the sequence). Turn sequence_parallel off, or set "
            "model.config.output_router_logits = False."
        )

    def expert_parallel_plan(self, expert_parallel_size: int) -> dict[str, str]:
        """The model's own expert-parallel plan, as names inside the module trained, checked for
        ``expert_parallel_size`` (see :mod:`lightning_pipe.huggingface.experts`)."""
        return expert_plan(self.parts, self.prefix, expert_parallel_size)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors the way the model's ``post_init`` would (a
        meta-built model's stage, materialised on its rank)."""
        self.model._init_weights(module)  # type: ignore[operator]

    def check(self, probe: Any, own_layers: Sequence[nn.Module] = ()) -> tuple[str | None, str | None]:
        """Whether the pipeline computes what the model's ``forward`` does (see
        :mod:`lightning_pipe.huggingface.check`)."""
        return check_pipeline(self, probe, own_layers)

    def check_sequence(
        self, probe: Any, own_layers: Sequence[nn.Module], group: dist.ProcessGroup
    ) -> str | None:
        """Whether this rank's decoder layers compute under sequence parallelism what they compute
        without it (see :mod:`lightning_pipe.huggingface.sequence_check`). With a balancing loss
        (which a plan given as an option does not stop earlier): an error on every rank."""
        if self.balancing is not None:
            return self._no_sequence_parallel()
        return check_sequence_split(self, probe, own_layers, group)

    def use_ring_attention(self) -> None:
        """Under context parallelism: the model's attention layers call ring attention, through
        transformers' attention interface (:mod:`lightning_pipe.huggingface.ring_attention`), and
        the model keeps no cache (training needs none; each rank's positions are not 0..n-1)."""
        from lightning_pipe.huggingface.ring_attention import use_ring_attention

        # What the ring cannot compute is refused now, before any work (its attention function
        # refuses it again at the call, for a model set to ring attention by hand).
        config, where = self.parts.config, f"{type(self.model).__name__} ({self.family})"
        reasons = []
        if getattr(config, "attn_logit_softcapping", None):
            reasons.append(
                f"soft-caps its attention logits (attn_logit_softcapping={config.attn_logit_softcapping})"
            )
        if any(getattr(m, "sinks", None) is not None for m in self.model.modules()):
            reasons.append("has attention sinks")
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            reasons.append(f"drops attention probabilities (attention_dropout={config.attention_dropout})")
        if reasons:
            raise UnsupportedModelError(
                f"context parallelism: {where} {' and '.join(reasons)}, which ring attention does not "
                "compute; use context_parallel_size=1 for this family (for dropout: attention_dropout=0)."
            )
        try:
            use_ring_attention(self.model)
        except (ValueError, NotImplementedError, AttributeError) as err:
            raise UnsupportedModelError(
                f"context parallelism: {type(self.model).__name__} ({self.family}) cannot select ring "
                f"attention through transformers' attention interface ({err}); use context_parallel_size=1."
            ) from err
        self.parts.config.use_cache = False

    def probe_kind(self, probe: Any) -> torch.Tensor:
        """Whether a first-layer input masks padding and whether it packs sequences (two flags on
        the device, which the runtime reads with the batch's token counts): the setup check runs
        again for each kind first seen (some families treat packed rows otherwise)."""
        _, mask, positions = probe
        padded = (mask == 0).any()  # False for the empty "no mask" stand-in
        packed = ((positions[..., 1:] - positions[..., :-1]) != 1).any()
        return torch.stack([padded, packed])

    def hooks(self) -> ModelHooks:
        return ModelHooks(
            pipeline_input=self.pipeline_input,
            layer_calls=self.calls(),
            check_forward=self.check,
            check_sequence=self.check_sequence,
            probe_kind=self.probe_kind,
            loss_items=self.loss_items,
            cut_sequence=cut_batch,
            replace_attention=self.use_ring_attention,
            splits_sequence=self.scatter_after_embedding,
        )


def _hidden_only(layer: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """A module of the hidden states alone (a dropout, the final norm); the rest passes by."""
    return (layer(args[0]), *args[1:])


def model_inputs(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``input_ids`` and, when the batch has them, ``attention_mask`` and ``position_ids``."""
    if isinstance(batch, Mapping):
        if not isinstance(batch.get("input_ids"), torch.Tensor):
            raise KeyError(
                f"A batch for a Hugging Face causal LM under pipe_tp is a dict with 'input_ids' (and "
                "optionally 'attention_mask', 'position_ids', 'labels'); this one has the keys "
                f"{sorted(batch)}. "
                "Define pipeline_input(self, batch) on the LightningModule to return such a dict."
            )
        return batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0], None, None
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    raise TypeError(
        f"A batch of type {type(batch).__name__} has no input ids for a Hugging Face causal LM: give a dict "
        "with 'input_ids' (a collator's output), a tensor of ids, or a tuple whose first element is one; or "
        "define pipeline_input(self, batch) on the LightningModule to return such a dict."
    )
