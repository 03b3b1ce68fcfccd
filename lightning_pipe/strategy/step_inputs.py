"""Learn from the user's step which of the batch's tensors it gives the Hugging Face model.

On the first batch of each step kind (and batch structure), before the engine runs it, every rank
runs the step once on the whole batch with the model's ``forward`` replaced by a recorder that
stops the step at its model call (a ``BaseException``, so that a step's ``except Exception`` does
not swallow it): no layer computes, and what the step logs before the call is dropped. The tensors
of the call are matched to the batch's by identity
(:func:`~lightning_pipe.huggingface.batch_roles.learn_roles`), and the ranks agree on the result
with one object gather over all ranks: a rank that learned otherwise, or failed, stops every rank
with one message, so that the first stage never feeds other tensors than the last stage's call
names, nor counts other labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.huggingface.batch_roles import BatchRoles, StepInputs, learn_roles
from lightning_pipe.huggingface.outputs import call_arguments
from lightning_pipe.strategy.log_capture import LogCapture, capturing

Gather = Callable[[Any], list[Any]]
"""An object from every rank (this rank's too), in rank order."""


class _Recorded(BaseException):
    """Stops the step at its model call, once the call's arguments are recorded."""


def record_model_call(
    module: LightningModule, step_name: str, args: tuple[Any, ...], model: nn.Module
) -> dict[str, Any] | None:
    """The arguments the step gives ``model``, by the names of its ``forward``; ``None`` when the
    step returns without calling it."""
    recorded: dict[str, Any] | None = None

    def recorder(*call_args: Any, **call_kwargs: Any) -> Any:
        nonlocal recorded
        recorded = call_arguments(model, call_args, call_kwargs)
        raise _Recorded

    before = model.__dict__.get("forward")  # e.g. accelerate's hook: put back, not deleted
    model.forward = recorder
    try:
        with capturing(module.trainer, LogCapture()):
            getattr(module, step_name)(*args)
    except _Recorded:
        pass
    finally:
        if before is None:
            del model.forward
        else:
            model.forward = before
    return recorded


def learn_step_inputs(
    module: LightningModule,
    step_name: str,
    args: tuple[Any, ...],
    model: nn.Module,
    inputs: StepInputs,
    gather: Gather,
) -> None:
    """Make ``inputs`` select, for this step, the batch tensors its model call takes (learned on
    this step kind's first batch of this structure; see the module docstring)."""
    batch = args[0]
    key = inputs.key(step_name, batch)
    if key in inputs.learned:
        inputs.active = inputs.learned[key]
        return
    call = f"{type(module).__name__}.{step_name} calls {type(model).__name__}"
    roles: BatchRoles | None = None
    error: BaseException | None = None
    try:
        given = record_model_call(module, step_name, args, model)
        roles = learn_roles(batch, given, call) if given is not None else None
    except Exception as err:  # every rank must hear of it before any waits on this one
        error = err
    text = None if error is None else f"{type(error).__name__}: {error}"
    everyone = gather((None if roles is None else str(roles), text))
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (_, message) in enumerate(everyone) if message is not None]
    if failed:
        rank, message = failed[0]
        raise MisconfigurationException(
            f"Rank {rank} stopped while running {step_name} once to find which of the batch's tensors it "
            f"gives {type(model).__name__}: {message}"
        )
    found = {learned for learned, _ in everyone}
    if len(found) > 1:
        lines = "\n".join(
            f"  rank {rank}: {learned or 'no model call'}" for rank, (learned, _) in enumerate(everyone)
        )
        raise MisconfigurationException(
            f"The ranks' {step_name} give {type(model).__name__} different tensors of their first batches:\n"
            f"{lines}\nEvery rank must find the model's inputs in the same places of the batch; unpack "
            "every batch alike, or define pipeline_input(self, batch) returning a dict {'input_ids': ..., "
            "'attention_mask': ..., 'labels': ...}."
        )
    inputs.learned[key] = roles
    inputs.active = roles
