"""``model(input_ids=..., labels=...)`` inside a step, answered by the pipeline.

On the last stage the user's step runs once per micro-batch, and the causal LM's call in it
(``self.model(**batch).loss``, or ``self(input_ids)`` whose ``forward`` calls the model) must
return what the pipeline computed for that micro-batch, not run the rank's copy of the whole
model (other stages' weights are not here). :class:`ModelCall` stands in for the model's
``forward``: it checks that it is called with the micro-batch's own inputs (the ones that went
through the pipeline: another mask, other positions, or a cache would be a silent difference
from one device, so it refuses them), and returns a ``CausalLMOutputWithPast`` whose ``logits``
are the pipeline's and whose ``loss``, given ``labels``, is Hugging Face's causal-LM loss: labels
shifted by one, ``-100`` ignored, the mean over the micro-batch's predicted tokens. The runtime
weights each micro-batch by its share of the batch's tokens (:meth:`CausalLMPipeline.loss_items`),
so the batch's loss is the mean over all its tokens, as one device computes it. A micro-batch
without any predicted token contributes a zero loss (not Hugging Face's 0/0).

With the router's load-balancing loss (``config.output_router_logits=True`` on a mixture of
experts; :mod:`~lightning_pipe.huggingface.balancing`) the pipeline output is ``(logits, aux)``,
and the answer is a ``MoeCausalLMOutputWithPast`` whose ``aux_loss`` is the micro-batch's ``aux``
and whose ``loss`` adds ``router_aux_loss_coef * aux``, as the model's own forward does (its
``router_logits`` stay on their stages: ``None``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from lightning_pipe.huggingface.context import IGNORE_INDEX, default_positions, mask_or_none
from lightning_pipe.tensor_parallel.cross_entropy import cross_entropy

if TYPE_CHECKING:
    from lightning_pipe.huggingface.view import PipelineView


class ModelCallError(ValueError):
    """The model was called inside a step in a way the pipeline did not run."""


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None = None,
    has_tokens: bool | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (mean over predicted tokens), in at least float32 (a
    float64 model keeps float64), vocab-parallel on sliced logits; zero without any token.
    ``has_tokens``: whether any label is predicted, when the caller knows it (otherwise the
    labels are read: on CUDA the host waits for the device)."""
    if shift_labels is None:
        if labels is None:
            raise ModelCallError("The causal-LM loss needs labels (or shift_labels).")
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if has_tokens is None:
        has_tokens = bool((shift_labels != IGNORE_INDEX).any())
    if not has_tokens:
        return logits.sum() * 0.0
    if logits.dtype in (torch.float16, torch.bfloat16):
        upcast = logits.float()
        from lightning_pipe.tensor_parallel.cross_entropy import copy_vocab_parallel_tag

        logits = copy_vocab_parallel_tag(upcast, logits)
    return cross_entropy(logits, shift_labels.to(logits.device), ignore_index=IGNORE_INDEX)


def call_arguments(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call ``model(*args, **kwargs)`` by the names of the model's ``forward``
    (positional ones named, the ``**kwargs`` catch-all flattened)."""
    signature = inspect.signature(type(model).forward)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError as err:
        raise ModelCallError(f"{type(model).__name__}(...) inside the step: {err}") from err
    given = dict(bound.arguments)
    given.pop("self", None)
    extra = given.pop("kwargs", {}) if "kwargs" in signature.parameters else {}
    given.update(extra)
    return given


class ModelCall:
    """The causal LM's ``forward`` for one micro-batch whose pipeline output is ``logits``.

    ``sources``: where the step takes each input (``{"attention_mask": "batch[1]"}``), for the
    messages (default: the dict keys ``batch['attention_mask']``). ``counted_labels``: ``items``
    were counted on ``microbatch``'s own ``labels`` (or ``shift_labels``) the way the loss counts
    them (the derived ``loss_items``).

    The checks compare what the step passes with what went through the pipeline; a tensor that
    *is* the micro-batch's own (the same object, as in ``self.model(**batch)``) is equal without
    reading it, so the usual call makes the host wait for nothing.
    """

    def __init__(
        self,
        pipeline: PipelineView,
        microbatch: Any,
        logits: torch.Tensor,
        items: float | None = None,
        sources: dict[str, str] | None = None,
        counted_labels: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.inputs = pipeline.pipeline_input(microbatch)
        self.aux_loss: torch.Tensor | None = None
        """The micro-batch's router load-balancing loss, when the pipeline carries one."""
        if isinstance(logits, tuple):  # (logits, aux): see the module docstring
            logits, self.aux_loss = logits
        self.logits = logits
        self.items = items
        """The micro-batch's loss items the runtime weighted it by (``None``: by samples)."""
        self.sources = sources or {}
        own = microbatch if isinstance(microbatch, Mapping) else {}
        self.own_positions = own.get("position_ids")
        """The micro-batch's own position ids (``None``: the pipeline ran the default ones)."""
        self.counted = (own.get("labels"), own.get("shift_labels")) if counted_labels else None
        """The labels ``items`` were counted on, when the derived ``loss_items`` counted them."""

    def source(self, role: str) -> str:
        return self.sources.get(role, f"batch[{role!r}]")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        given = call_arguments(self.pipeline.model, args, kwargs)
        self._check_inputs(given)
        aux = self._aux_loss(given.get("output_router_logits"))
        labels = given.get("labels")
        loss = None
        if labels is not None or given.get("shift_labels") is not None:
            if given.get("num_items_in_batch") is not None:
                raise ModelCallError(
                    "num_items_in_batch= is given to the model inside the step; under pipe_tp the loss of "
                    "each micro-batch is its mean over its own tokens and the runtime weights it by its "
                    "share of the batch's tokens (the whole batch's mean, as on one device). Leave it out."
                )
            known = self._check_items(labels, given.get("shift_labels"))
            loss = causal_lm_loss(self.logits, labels, given.get("shift_labels"), known)
            balancing = self.pipeline.balancing
            if aux is not None and balancing is not None:  # the pipeline carries aux only then
                loss = loss + balancing.coefficient * aux.to(loss.device)
        for flag in ("output_hidden_states", "output_attentions"):
            if given.get(flag):
                raise ModelCallError(
                    f"{type(self.pipeline.model).__name__}({flag}=True) inside the step: under pipe_tp the "
                    "last stage holds the logits only (each stage's hidden states stay on its rank). Leave "
                    f"{flag} out, or compute what you need from the logits."
                )
        if aux is not None:
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=self.logits)
        return CausalLMOutputWithPast(loss=loss, logits=self.logits)

    def _aux_loss(self, asked: bool | None) -> torch.Tensor | None:
        """The load-balancing loss the call asks for (``output_router_logits=``, else the config's),
        which the pipeline must have carried."""
        if asked is not None and not asked:
            return None  # the model's own forward computes none then either
        config = self.pipeline.parts.config
        if asked and not getattr(config, "output_router_logits", False):
            raise ModelCallError(
                f"{type(self.pipeline.model).__name__}(output_router_logits=True) inside the step, but the "
                "model's config has output_router_logits=False, so the pipeline did not carry the routers' "
                "statistics for the load-balancing loss. Set model.config.output_router_logits = True before "
                "the Trainer starts (e.g. in configure_model) instead of passing it to the call."
            )
        return self.aux_loss

    def _check_items(self, labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> bool | None:
        """The loss asked for averages over the tokens the runtime weighted this micro-batch by;
        otherwise the batch's loss would not be its mean over tokens, as on one device. Returns
        whether the loss has any token, when that is known without reading the labels."""
        if self.counted is not None and self.items is not None:
            own_labels, own_shifted = self.counted
            if shift_labels is not None and shift_labels is own_shifted:
                return self.items > 0  # counted on these very labels
            if shift_labels is None and own_shifted is None and labels is not None and labels is own_labels:
                return self.items > 0
        shifted = shift_labels if shift_labels is not None else labels[..., 1:]  # type: ignore[index]
        name = type(self.pipeline.model).__name__
        if self.items is None:
            if bool((shifted == IGNORE_INDEX).any()):
                raise ModelCallError(
                    f"The labels given to {name} inside the step ignore some tokens (-100), but pipe_tp "
                    "found no 'labels' in the batch to count them, so it weighs the micro-batches by "
                    "samples and the batch's loss would not be its mean over tokens as on one device. Pass "
                    "the batch's own labels tensor to the call (pipe_tp finds it in the batch), return them "
                    "from pipeline_input(self, batch), or define loss_items(self, batch) giving each "
                    "sample's number of target tokens."
                )
            return None
        count = int((shifted != IGNORE_INDEX).sum())
        if count != round(self.items):
            raise ModelCallError(
                f"The labels given to {name} inside the step have {count} target tokens in this "
                f"micro-batch, but the batch's labels have {round(self.items)}, which pipe_tp weighted it "
                f"by. Pass the batch's labels (labels={self.source('labels')}), or define "
                "loss_items(self, batch) counting the tokens your loss averages over."
            )
        return count > 0

    def _check_inputs(self, given: dict[str, Any]) -> None:
        name = type(self.pipeline.model).__name__
        input_ids, mask, positions = self.inputs
        if given.get("inputs_embeds") is not None:
            raise ModelCallError(
                f"{name}(inputs_embeds=...) inside the step: under pipe_tp the pipeline starts from the "
                "batch's input_ids (the embedding is on the first stage); pass input_ids."
            )
        if given.get("past_key_values") is not None:
            raise ModelCallError(
                f"{name}(past_key_values=...) inside a training or evaluation step is not supported."
            )
        keep = given.get("logits_to_keep", 0)
        if keep not in (0, None):
            raise ModelCallError(
                f"{name}(logits_to_keep={keep}) inside the step: the pipeline computes the logits of every "
                "position; slice them yourself."
            )
        ids = given.get("input_ids")
        if (
            not isinstance(ids, torch.Tensor)
            or ids.shape != input_ids.shape
            or (ids is not input_ids and not torch.equal(ids, input_ids))
        ):
            raise ModelCallError(
                f"{name}(input_ids=...) inside the step was not given the micro-batch's input_ids, which "
                f"are what went through the pipeline ({self.source('input_ids')} on this step's first "
                "batch). Call the model with the batch's own tensors; to feed something else, return it from "
                "pipeline_input(self, batch)."
            )
        theirs = given.get("attention_mask")
        ours = mask_or_none(mask)
        if (theirs is None) != (ours is None) or (
            theirs is not None
            and ours is not None
            and theirs is not ours
            and not torch.equal(theirs.to(ours.dtype), ours)
        ):
            source = self.source("attention_mask")
            had = f"with the attention_mask {source}" if ours is not None else "without an attention_mask"
            got = "without one" if theirs is None else "with one" if ours is None else "with another one"
            fix = f"Pass attention_mask={source}" if ours is not None else "Leave attention_mask out"
            raise ModelCallError(
                f"The pipeline ran this micro-batch {had}, but the step calls {name} {got}: the logits would "
                f"not be what the call asks for. {fix} in every step, as on the step's first batch (or "
                "return what the model needs from pipeline_input(self, batch))."
            )
        theirs_pos = given.get("position_ids")
        if theirs_pos is not None and theirs_pos is self.own_positions:
            return  # the very positions the pipeline ran
        if theirs_pos is None and self.own_positions is None:
            return  # both the default ones of these input_ids
        expected = default_positions(input_ids) if theirs_pos is None else theirs_pos
        if not torch.equal(expected.expand_as(positions).to(positions.dtype), positions):
            raise ModelCallError(
                f"The pipeline ran this micro-batch with the position_ids {self.source('position_ids')}, but "
                f"the step calls {name} with other ones (or none). Pass position_ids="
                f"{self.source('position_ids')}."
            )
