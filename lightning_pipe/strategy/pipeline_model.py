"""What the strategy reads from a LightningModule: its pipeline, written by the user or derived.

A module that defines ``configure_pipeline()`` gives its layers, and optionally
``pipeline_input(batch)``, ``tensor_parallel_plan()`` and ``init_module_weights(module)``. A module
without it that holds a Hugging Face causal LM (``self.model = AutoModelForCausalLM...``) gets all
of these from the model itself (:mod:`lightning_pipe.huggingface`): no wrappers to write. Either way
the result is one :class:`PipelineModel`: the layers, the engine's
:class:`~lightning_pipe.runtime.hooks.ModelHooks`, the tensor-parallel plan, the initialiser, the
pretrained files' prefix, and how the model's call inside a step is answered with the pipeline's
output (:data:`Redirect`).

The derived pipeline is kept on the module (like the preparation, :mod:`lightning_pipe.runtime.prepare`),
so that later Trainer calls (validate after fit) use the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.construction.materialize import InitFn
from lightning_pipe.huggingface.batch_roles import ROLES, StepInputs
from lightning_pipe.huggingface.parts import UnsupportedModelError, is_causal_lm
from lightning_pipe.runtime import Microbatch, ModelHooks

_DERIVED = "_lightning_pipe_huggingface"

Redirect = Callable[[Microbatch, Any], tuple[nn.Module, Callable[..., Any], str]]
"""For a micro-batch and its pipeline output on the last stage: the module whose call the step
makes, the reply that call gets, and how the step writes the call (for messages)."""


@dataclass
class PipelineModel:
    """A LightningModule as the runtime takes it (see the module docstring)."""

    layers: list[nn.Module]
    hooks: ModelHooks
    redirect: Redirect
    init: InitFn | None = None
    tensor_parallel_plan: dict[str, str] | None = None
    pretrained_prefix: str = ""
    notes: list[str] = field(default_factory=list)
    """Lines for the start-of-run log (what a derived tensor-parallel plan leaves whole)."""
    huggingface: Any = None
    """The derived :class:`~lightning_pipe.huggingface.CausalLMPipeline`, if any."""
    step_inputs: StepInputs | None = None
    """A derived pipeline's batch roles, learned from each step kind's first batch (``None`` when
    the module defines ``pipeline_input``, or gives its own layers)."""


def _own_reply(module: LightningModule) -> Redirect:
    def redirect(microbatch: Microbatch, output: Any) -> tuple[nn.Module, Callable[..., Any], str]:
        return module, lambda *args, **kwargs: output, "self(...)"

    return redirect


def find_causal_lm(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The one Hugging Face causal LM the module holds (outermost), with its name; ``None`` when
    there is none; an error naming them when there are several."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if name and is_causal_lm(sub) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, sub))
    if len(found) > 1:
        raise MisconfigurationException(
            f"{type(module).__name__} holds several Hugging Face causal LMs ({[n for n, _ in found]}), so "
            "pipe_tp cannot tell which one to pipeline; define configure_pipeline() to list the layers."
        )
    return found[0] if found else None


def _method(module: LightningModule, name: str) -> Callable[..., Any] | None:
    """The module's optional hook ``name``, when it defines one."""
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def read_module(
    module: LightningModule,
    first: bool,
    tensor_parallel_size: int,
    plan_option: dict[str, str] | None,
    prefix_option: str | None,
    sequence_parallel: bool = False,
) -> PipelineModel:
    """The module's pipeline (``first``: its first setup, when the layers are split; later calls
    reuse the split, so no layers are given then). ``sequence_parallel``: a derived Hugging Face
    plan also says where the sequence is split and gathered."""
    user_input = _method(module, "pipeline_input")
    user_init = _method(module, "init_module_weights")
    user_items = _method(module, "loss_items")
    # A plan is needed once, when the layers are split: the option, else the module's hook, else
    # (for a derived Hugging Face pipeline) the model's own.
    plan_hook = _method(module, "tensor_parallel_plan")
    wants_plan = first and plan_option is None and tensor_parallel_size > 1
    plan = plan_hook() if wants_plan and plan_hook is not None else plan_option
    if callable(getattr(module, "configure_pipeline", None)):
        return PipelineModel(
            layers=list(module.configure_pipeline()) if first else [],  # type: ignore[operator]
            hooks=ModelHooks(pipeline_input=user_input, loss_items=user_items),
            redirect=_own_reply(module),
            init=user_init,
            tensor_parallel_plan=plan,
            pretrained_prefix=prefix_option or "",
        )
    pipeline = module.__dict__.get(_DERIVED)
    if pipeline is None:
        found = find_causal_lm(module)
        if found is None:
            raise MisconfigurationException(
                f"{type(module).__name__} has no configure_pipeline() method and holds no Hugging Face "
                "causal LM, so the pipe_tp strategy cannot tell its layers: return the ordered list of "
                "layers to split into stages, e.g. `def configure_pipeline(self): return list(self.layers)`."
            )
        from lightning_pipe.huggingface.adapters import check_peft_materialised
        from lightning_pipe.huggingface.pipeline import CausalLMPipeline

        try:
            pipeline = CausalLMPipeline(found[1], found[0])
        except UnsupportedModelError as err:
            raise MisconfigurationException(str(err)) from err
        try:
            check_peft_materialised(module, found[0])
        except ValueError as err:
            raise MisconfigurationException(str(err)) from err
        module.__dict__[_DERIVED] = pipeline
    notes: list[str] = []
    if wants_plan and plan_hook is None:
        try:
            derived = pipeline.tensor_parallel_plan(tensor_parallel_size, sequence_parallel)
        except UnsupportedModelError as err:
            raise MisconfigurationException(str(err)) from err
        plan, notes = derived.plan, derived.notes
    return _derived(pipeline, first, plan, notes, prefix_option, user_input, user_init, user_items)


def _derived(
    pipeline: Any,
    first: bool,
    plan: dict[str, str] | None,
    notes: list[str],
    prefix_option: str | None,
    user_input: Callable[[Any], Any] | None,
    user_init: InitFn | None,
    user_items: Callable[[Any], Any] | None,
) -> PipelineModel:
    from lightning_pipe.huggingface.outputs import ModelCall

    hooks = pipeline.hooks()
    derived_input, derived_items = hooks.pipeline_input, hooks.loss_items
    # Without the user's pipeline_input, the batch's tensors are those the step gives the model,
    # learned from the step (the strategy's prepare_step sets them before each step).
    learned: StepInputs | None = pipeline.step_inputs if user_input is None else None
    if learned is not None:
        learned.active = None  # until a step sets them (not e.g. for forward's example input)

    def users(batch: Any) -> Any:
        return user_input(batch) if user_input is not None else pipeline.step_inputs.select(batch)

    # Tokens are counted on what the user's pipeline_input (or the learned roles) make of the
    # batch (labels may appear only there, e.g. from a tuple batch).
    hooks = dataclasses.replace(
        hooks,
        pipeline_input=lambda batch: derived_input(users(batch)),
        loss_items=user_items if user_items is not None else lambda batch: derived_items(users(batch)),
    )
    model = pipeline.model

    def redirect(microbatch: Microbatch, output: Any) -> tuple[nn.Module, Callable[..., Any], str]:
        data = users(microbatch.data)
        if user_input is not None:
            sources = {role: f"pipeline_input(batch)[{role!r}]" for role in ROLES}
        else:
            sources = pipeline.step_inputs.sources()
        # The derived loss_items counted the very labels the micro-batch holds (no read to check).
        reply = ModelCall(
            pipeline, data, output, microbatch.items, sources, counted_labels=user_items is None
        )
        return model, reply, f"self.{pipeline.name}(...)"

    return PipelineModel(
        layers=pipeline.layers() if first else [],
        hooks=hooks,
        redirect=redirect,
        init=user_init or pipeline.init_weights,
        tensor_parallel_plan=plan,
        pretrained_prefix=pipeline.prefix if prefix_option is None else prefix_option,
        notes=notes,
        huggingface=pipeline,
        step_inputs=learned,
    )


def expert_parallel_plan(
    view: PipelineModel, expert_parallel_size: int, option: Mapping[str, str] | None
) -> Mapping[str, str] | None:
    """The expert-parallel plan: the option, else a derived Hugging Face pipeline's (from the
    model's ``base_model_ep_plan``, refused with the reason where it cannot be dispatched)."""
    if option is not None or expert_parallel_size == 1 or view.huggingface is None:
        return option
    try:
        plan: dict[str, str] = view.huggingface.expert_parallel_plan(expert_parallel_size)
    except UnsupportedModelError as err:
        raise MisconfigurationException(str(err)) from err
    return plan
