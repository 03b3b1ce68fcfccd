"""``torch.compile`` per pipeline layer: the ``compile`` option (torchtitan compiles each transformer
block the same way).

Each pipeline layer of the stages a rank holds is compiled on its own, after tensor-parallel
slicing and FSDP2 wrapping, so the graph Dynamo traces (at the layer's first call, as compilation
is lazy) is the sliced layer that runs. What is compiled is the layer's ``forward``, bound to the
layer and set on it as an attribute, not its ``__call__`` (which ``nn.Module.compile()`` would
compile):

* The module stays the model's own object: its name, its parameters' names, the partition,
  checkpoints and tensor-parallel plans see no ``_orig_mod.`` wrapper (``torch.compile(layer)``
  returns a new module holding the layer under that name).
* The layer's own hooks run around the compiled forward, eagerly: FSDP2's, which gather and free a
  unit's parameters and which Dynamo cannot trace into one graph, stay outside it, as they do in
  torchtitan (whose FSDP units wrap the compiled block). Hooks of modules *inside* the layer are
  traced with it.
* Each layer is its own compiled region, so a pipeline can stop between any two layers (stage
  boundaries, recomputation, the executor's checks) without a graph break. Inside a layer, only
  tensor parallelism's collectives break the graph (``fullgraph=True`` is refused with it).

A layer the user compiled already is run as it is and not compiled again: an ``OptimizedModule``
(``torch.compile(layer)``) placed in the model, or a layer whose ``compile()`` was called.

Under zero-bubble schedules a compiled layer's backward is one autograd node (AOTAutograd's
compiled joint graph, a custom ``autograd.Function``) that computes every gradient of the layer in
one call, so :mod:`.split_backward` computes such a layer's weight gradients with its input
gradient (the rule for custom functions): equal to eager, with no weight work left for the bubble
from compiled layers (torch's own zero-bubble stages refuse compiled stages instead,
pytorch/pytorch#161904). That input pass keeps the graph for the weight pass, which a compiled
backward with donated buffers refuses: :func:`keeping_graph` turns them off for such calls.

Random numbers: ``aot_eager`` draws dropout masks as eager layers do; inductor draws its own
(``torch._inductor.config.fallback_random=True`` for eager's). Either way recomputation, which
restores the random state before running a layer again, replays the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch._functorch.config  # not imported by `import torch` alone
from torch import nn

CompileOption = bool | Mapping[str, Any]
"""``True`` (``torch.compile``'s defaults), ``False`` (off) or ``torch.compile``'s keyword arguments."""

_MARK = "_lightning_pipe_compiled"
"""Attribute set on a layer this module compiled (so a second setup does not compile it again)."""

_REFUSED = ("model", "disable")
"""``torch.compile`` arguments the option cannot take: the layers are the model, and ``False`` is
how to switch compilation off."""


def compile_arguments(value: object) -> dict[str, Any] | None:
    """The ``compile`` option checked, as ``torch.compile``'s keyword arguments (``None``: off)."""
    if isinstance(value, bool):
        return {} if value else None
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        refused = [k for k in value if k in _REFUSED]
        if refused:
            raise ValueError(
                f"compile={dict(value)!r}: {refused} is not a torch.compile argument the option takes "
                "(the layers are compiled one by one; compile=False switches compilation off)."
            )
        unknown = [k for k in value if k not in _ACCEPTED]
        if unknown:
            raise ValueError(
                f"compile={dict(value)!r}: {unknown} is not an argument of torch.compile; use "
                f"{sorted(_ACCEPTED)}, e.g. compile={{'backend': 'inductor', 'fullgraph': True}}."
            )
        return dict(value)
    raise ValueError(
        f"compile must be True, False or a dict of torch.compile keyword arguments (e.g. "
        f"{{'backend': 'aot_eager', 'fullgraph': True}}), got {value!r}."
    )


_ACCEPTED = frozenset(("fullgraph", "dynamic", "backend", "mode", "options"))
"""``torch.compile``'s keyword arguments but ``model`` and ``disable``."""


def user_compiled(layer: nn.Module) -> bool:
    """Whether ``layer`` was compiled by its user (run as it is)."""
    return isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(layer, "_compiled_call_impl", None) is not None
    )


def compiled_here(layer: nn.Module) -> bool:
    """Whether :func:`compile_layers` compiled ``layer``."""
    return _MARK in vars(layer)


def compile_layers(
    layers: Iterable[nn.Module], arguments: Mapping[str, Any] | None, tensor_parallel_size: int = 1
) -> list[nn.Module]:
    """Compile each of ``layers`` in place (its ``forward``, see the module docstring) with
    ``torch.compile(**arguments)`` (``None``: nothing); layers compiled already (by the user, or by
    an earlier setup) are left as they are. Returns the layers compiled now.

    Under tensor parallelism the layers' collectives (c10d calls inside ``autograd.Function``s,
    :mod:`lightning_pipe.tensor_parallel`) are not traceable: Dynamo breaks the graph at each and
    runs it eagerly, so ``fullgraph=True`` is refused there, naming the fix."""
    layers = list(layers)
    done: list[nn.Module] = []
    if any(user_compiled(module) for layer in layers for module in layer.modules()):  # see keeping_graph
        _state.compiled = True
    if arguments is None:
        return done
    if arguments.get("fullgraph") and tensor_parallel_size > 1:
        raise ValueError(
            f"compile={dict(arguments)!r} with tensor_parallel_size={tensor_parallel_size}: the "
            "tensor-parallel layers' collectives break the compiled graph (Dynamo runs them eagerly "
            "between graphs), so fullgraph=True cannot hold. Leave fullgraph out (or False), or "
            "compile without tensor parallelism."
        )
    for layer in layers:
        if compiled_here(layer) or user_compiled(layer):
            continue
        eager = layer.forward
        layer.forward = torch.compile(eager, **arguments)
        setattr(layer, _MARK, eager)
        done.append(layer)
        _state.compiled = True
    return done


class _DonatedBuffersOff:
    """AOTAutograd's ``donated_buffer`` setting off inside the block, put back after it."""

    def __enter__(self) -> None:
        config = torch._functorch.config
        self.before = config.donated_buffer
        if self.before:
            config.donated_buffer = False

    def __exit__(self, *_: object) -> None:
        if self.before:
            torch._functorch.config.donated_buffer = True


_NOTHING = contextlib.nullcontext()


def keeping_graph() -> contextlib.AbstractContextManager[None]:
    """Around a backward call that keeps the graph (``retain_graph=True``: the split backward's
    input pass, kept for its weight pass). AOTAutograd's compiled backward otherwise refuses such a
    call when it was compiled with donated buffers (freeing what it saved as it goes); with the
    setting off during the call it runs a backward that keeps them. Each compiled backward still
    runs once: the split backward computes a compiled layer's every gradient in its input pass.

    Only once a runtime of this process holds compiled layers (reading and setting the setting
    costs about 10 µs a call); a layer compiled another way (``torch.compile`` called inside a
    layer's ``forward``) meets torch's own error under zero-bubble schedules, which names the
    setting."""
    return _DonatedBuffersOff() if _state.compiled else _NOTHING


class _State:
    compiled = False
    """Whether a runtime of this process holds a compiled layer (ours, or one its user compiled)."""


_state = _State()
