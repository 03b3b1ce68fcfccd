"""Learn from the user's step which of the batch's tensors it gives the Hugging Face model.

On the first batch of each step kind (and batch structure), before the engine runs it, every rank
runs the step once on a structural copy of the batch (new dicts, lists, tuples and dataclasses
holding the same tensors, so that a step's ``batch.pop('labels')`` leaves the real batch whole)
with the model's ``forward`` replaced by a recorder that stops the step at its model call (a
``BaseException``, so that a step's ``except Exception`` does not swallow it): no layer computes,
what the step logs before the call is dropped, and the random number generators (CPU and the
current accelerator) are put back as they were. Anything else the step does before its model
call (a counter of its own, a change to the module) runs once more on that first batch. The
tensors of the call are matched to the batch's
(:func:`~lightning_pipe.huggingface.batch_roles.learn_roles`), and the ranks of the model replica
(the pipeline and tensor ranks that share the batch) agree on the result with one object gather
over the replica's group: a rank that learned otherwise, or failed, stops the replica's ranks with
one message, so that the first stage never feeds other tensors than the last stage's call names,
nor counts other labels. Other replicas are not waited for: one may meet a new batch structure
(and learn) at a step where the others do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pipe.huggingface.batch_roles import BatchRoles, StepInputs, learn_roles, structural_copy
from lightning_pipe.huggingface.outputs import call_arguments
from lightning_pipe.strategy.log_capture import LogCapture, capturing

Gather = Callable[[Any], dict[int, Any]]
"""An object from every rank of this rank's model replica (this rank's too), by global rank."""


class _Recorded(BaseException):
    """Stops the step at its model call, once the call's arguments are recorded."""


def record_model_call(
    module: LightningModule, step_name: str, args: tuple[Any, ...], model: nn.Module
) -> dict[str, Any] | None:
    """The arguments the step gives ``model``, by the names of its ``forward``; ``None`` when the
    step returns without calling it. The step runs on a structural copy of the batch
    (``args[0]``) and leaves the random number generators as they were."""
    recorded: dict[str, Any] | None = None

    def recorder(*call_args: Any, **call_kwargs: Any) -> Any:
        nonlocal recorded
        recorded = call_arguments(model, call_args, call_kwargs)
        raise _Recorded

    before = model.__dict__.get("forward")  # e.g. accelerate's hook: put back, not deleted
    model.forward = recorder
    # The step's draws before its call (dropout of its own, a random crop) must not move the
    # generators: the real run draws them again.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with capturing(module.trainer, LogCapture()), torch.random.fork_rng(devices=devices):
            getattr(module, step_name)(structural_copy(args[0]), *args[1:])
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
    failed = [(rank, message) for rank, (_, message) in everyone.items() if message is not None]
    if failed:
        rank, message = failed[0]
        raise MisconfigurationException(
            f"Rank {rank} stopped while running {step_name} once to find which of the batch's tensors it "
            f"gives {type(model).__name__}: {message}"
        )
    found = {learned for learned, _ in everyone.values()}
    if len(found) > 1:
        lines = "\n".join(
            f"  rank {rank}: {learned or 'no model call'}" for rank, (learned, _) in everyone.items()
        )
        raise MisconfigurationException(
            f"The ranks' {step_name} give {type(model).__name__} different tensors of their first batches:\n"
            f"{lines}\nEvery rank must find the model's inputs in the same places of the batch; unpack "
            "every batch alike, or define pipeline_input(self, batch) returning a dict {'input_ids': ..., "
            "'attention_mask': ..., 'labels': ...}."
        )
    inputs.learned[key] = roles
    inputs.active = roles
