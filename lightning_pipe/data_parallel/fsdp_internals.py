"""The few private calls into torch's FSDP2 that a pipeline needs, in one place.

FSDP2 reduces a unit's gradients from autograd hooks: when a backward reaches the unit's inputs, and
in a callback its root queues at the end of each backward. A pipeline's backward is not one
``loss.backward()``: it is one per micro-batch (and, under zero-bubble schedules, an input-gradient
pass and a later weight-gradient pass), so the reduction is deferred over the whole step and
triggered by hand after the stage's last backward. torch's own pipelining does exactly this
(``torch/distributed/pipelining/stage.py``, ``perform_reduce_grad``), with the same private
members; there is no public equivalent in torch 2.13. Each function below names the member it
uses, so that a torch upgrade that renames one fails here, in one module, with a clear message.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import nn


def _state(root: nn.Module) -> Any:
    # Imported here: FSDP2 (and DTensor with it) costs about a second to import, and the engine
    # reaches this module (``collective_of``) whether parameters are sharded or not.
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)  # type: ignore[attr-defined]
    for member in ("_lazy_init", "_state_ctx", "_root_post_backward_final_callback"):
        if not hasattr(state, member):
            raise RuntimeError(
                f"torch {torch.__version__}'s FSDP2 state has no {member!r}, which lightning_pipe's "
                "shard_parameters=True relies on (as torch.distributed.pipelining does): use the torch "
                "versions lightning_pipe supports, or shard_parameters=False."
            )
    return state


def make_root(root: nn.Module) -> None:
    """Make ``root`` the FSDP root of every unit inside it now, instead of at its first forward.

    FSDP2 picks as root the first unit that runs forward. Before a stage's first scheduled
    forward, other code may call its layers directly (the check that ``forward`` is the chained
    layers, a Hugging Face model's own forward in its setup check); a layer run that way would
    become a root of its own, and the stage's container would then be refused as a root.
    """
    _state(root)._lazy_init()


def _params(root: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` under ``root``."""
    state = _state(root)
    return [p for s in state._state_ctx.all_states for g in s._fsdp_param_groups for p in g.fsdp_params]


def _upcast_deferred(root: nn.Module) -> None:
    """Under a ``reduce_dtype`` (mixed precision), give every trainable parameter its deferred
    gradient in that dtype before the reduction.

    With the reduction deferred, FSDP moves a gradient into a float32 accumulator at each backward
    hook; a gradient that arrived after its unit's last hook (a zero-bubble weight pass) is still
    bfloat16 in ``.grad``, and a parameter without one gets bfloat16 zeros, and FSDP refuses a
    reduce-scatter of mixed dtypes ("expects uniform gradient dtype") on that rank alone, leaving
    its peers waiting. Zeros stand for a parameter without a gradient: which parameters no rank
    used is settled after the reduction.
    """
    for param in _params(root):
        if param.reduce_dtype is None or not hasattr(param, "_unsharded_param"):
            continue
        unsharded = param._unsharded_param
        if not unsharded.requires_grad or unsharded.dtype == param.reduce_dtype:
            continue
        grad, accumulated = unsharded.grad, param.unsharded_accumulated_grad
        if grad is not None:
            accumulated = grad.to(param.reduce_dtype) if accumulated is None else accumulated.add_(grad)
            unsharded.grad = None
        if accumulated is None:
            accumulated = torch.zeros_like(unsharded, dtype=param.reduce_dtype)
        param.unsharded_accumulated_grad = accumulated


def discard_unreduced(root: nn.Module) -> None:
    """Drop gradients a window gathered but never reduced (it was cut short by an exception), and
    reset FSDP's per-iteration state (``reset_iter_state``, torch's documented recovery), so that
    the next window neither adds them in nor keeps the stage gathered."""
    for param in _params(root):
        param.unsharded_accumulated_grad = None
        if hasattr(param, "_unsharded_param"):
            param._unsharded_param.grad = None
    root.reset_iter_state()  # type: ignore[operator]


def reduce_gradients(root: nn.Module) -> None:
    """Reduce-scatter (and, under HSDP, all-reduce) every unit's accumulated gradient now, then
    finish FSDP's backward: ``post_backward`` of every parameter group under ``root``, then the
    root's end-of-backward callback (which also resets FSDP's per-iteration state)."""
    _upcast_deferred(root)
    state = _state(root)
    for unit_state in state._state_ctx.all_states:
        for param_group in unit_state._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()


_GATHERING = "all-gathering parameters over the data-parallel group (FSDP2)"
_REDUCING = "reduce-scattering gradients over the data-parallel group (FSDP2)"
_COLLECTIVE_FRAMES = {
    # FSDP2's functions (torch/distributed/fsdp/_fully_shard/) that run or wait for a collective.
    "foreach_all_gather": _GATHERING,
    "foreach_all_gather_copy_out": _GATHERING,
    "wait_for_unshard": _GATHERING,
    "unshard": _GATHERING,
    "_prefetch_unshard": _GATHERING,
    "_backward_prefetch": _GATHERING,
    "pre_forward": _GATHERING,
    "pre_backward": _GATHERING,
    "_reset_iter_state": _GATHERING,
    "finalize_backward": _GATHERING,
    "foreach_reduce": _REDUCING,
    "post_backward": _REDUCING,
    "_root_post_backward_final_callback": _REDUCING,
}


def collective_of(err: BaseException) -> str | None:
    """What FSDP2 was doing when ``err`` was raised inside it ("all-gathering parameters over the
    data-parallel group (FSDP2)", or reduce-scattering gradients), from the innermost of its
    functions on the error's traceback; ``None`` when the error did not come from FSDP2.

    FSDP2 runs its collectives inside module and autograd hooks, where no caller can name them;
    the traceback still holds its frames (autograd re-raises a hook's Python error with them)."""
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        if "_fully_shard" in frame.filename.replace("\\", "/") and frame.name in _COLLECTIVE_FRAMES:
            return _COLLECTIVE_FRAMES[frame.name]
    return None
