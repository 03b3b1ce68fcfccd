"""Check that a model's ``forward`` is exactly its pipeline layers applied in order.

Under the pipeline, ``self(x)`` inside a step returns the *pipeline's* output: the layers of
``configure_pipeline()`` chained (:func:`~lightning_pipe.execution.executor.apply_layers`). Logic that
``forward`` adds around them (a residual around the layers, a final activation, a scaled input)
is then skipped in training, and the same checkpoint served with ``forward`` on one device runs
another model. That difference is silent, so it is checked once, on one probe micro-batch:

1. *Structurally*, at no compute cost: every layer's ``forward`` is replaced by a stub that
   returns a fresh view of its input, and ``forward(probe)`` must call the stubs in pipeline
   order, each with exactly the previous stub's output (the first with the probe itself), and
   return exactly the last stub's output.
2. *Numerically*, when (1) does not hold, for forwards that reach the same modules another way
   (``self.hf_model(ids).logits`` beside wrappers of its blocks, a U-Net's ``forward`` handing its
   skips to the up blocks): ``forward(probe)`` and the chained layers (their skips stashed and
   popped in one scope, as the pipeline passes them) are run without gradients and compared.

Both run in eval mode, what a served model runs. This needs every tensor of the model
   on the probe's device; where that is not so, the check can only warn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.execution.layers import apply_layers, evaluating
from lightning_pipe.skip.scope import skip_scope

_RTOL, _ATOL = 1e-4, 1e-5
_Call = tuple[int, tuple[Any, ...], dict[str, Any], Any]
"""A stubbed layer call: layer index, positional and keyword arguments, the stub's output."""


class _UncheckedError(Exception):
    """The numeric comparison could not run (devices, or forward raised)."""


def _call(fn: Callable[..., Any], x: Any) -> Any:
    """Call ``fn`` the way :func:`apply_layers` feeds a layer: a tuple becomes positional args."""
    return fn(*x) if isinstance(x, tuple) else fn(x)


def _fresh(args: tuple[Any, ...]) -> Any:
    views = tuple(a.view_as(a) if isinstance(a, torch.Tensor) else a for a in args)
    return views[0] if len(views) == 1 else views


def _same(a: Any, b: Any) -> bool:
    """``b`` is ``a`` itself, or a tuple of exactly ``a``'s elements."""
    if a is b:
        return True
    a_items = a if isinstance(a, tuple) else (a,)
    b_items = b if isinstance(b, tuple) else (b,)
    return len(a_items) == len(b_items) and all(x is y for x, y in zip(a_items, b_items, strict=True))


@contextlib.contextmanager
def _stubbed(
    layers: Sequence[nn.Module], calls: list[tuple[int, tuple[Any, ...], dict[str, Any], Any]]
) -> Iterator[None]:
    def stub(index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = _fresh(args)
            calls.append((index, args, kwargs, out))
            return out

        return forward

    # The stubs stand in for the layers entirely: the layers' own forward hooks (a user's
    # activation statistics, a counter) must not see the stubs' placeholder outputs.
    hook_dicts = [name for name in vars(nn.Module()) if name.startswith("_forward") and "hooks" in name]
    saved = [{name: getattr(layer, name) for name in hook_dicts} for layer in layers]
    # A forward set on the instance (the compile option's compiled forward) is put back, not deleted.
    patched = [layer.__dict__.get("forward") for layer in layers]
    for index, layer in enumerate(layers):
        layer.forward = stub(index)
        for name in hook_dicts:
            setattr(layer, name, type(getattr(layer, name))())
    try:
        yield
    finally:
        for layer, hooks, before in zip(layers, saved, patched, strict=True):
            if before is None:
                del layer.forward
            else:
                layer.forward = before
            for name, value in hooks.items():
                setattr(layer, name, value)


def _structural(forward: Callable[..., Any], layers: Sequence[nn.Module], probe: Any) -> str | None:
    """``None`` if ``forward`` is the plain chain of ``layers``, else what it does instead."""
    calls: list[_Call] = []
    try:
        with _stubbed(layers, calls), torch.no_grad():
            result = _call(forward, probe)
    except NotImplementedError:
        raise
    except Exception as err:  # the stubs' outputs are not what forward expects: decide by numbers
        return f"forward raised {type(err).__name__} when its layers were replaced by stubs"
    order = [index for index, *_ in calls]
    if order != list(range(len(layers))):
        return f"forward called the pipeline layers in the order {order}, not 0..{len(layers) - 1} once each"
    previous = probe
    for index, args, kwargs, out in calls:
        if kwargs:
            return f"forward passed keyword arguments {sorted(kwargs)} to pipeline layer {index}"
        if not _same(previous, args if len(args) > 1 else args[0]):
            where = "the pipeline input" if index == 0 else f"the output of layer {index - 1}"
            return f"pipeline layer {index} was not called with exactly {where} (forward changes it)"
        previous = out
    if not _same(previous, result):
        return "forward does not return exactly the last pipeline layer's output (it changes it)"
    return None


def _numeric(
    forward: Callable[..., Any], layers: Sequence[nn.Module], model: nn.Module, probe: Any
) -> str | None:
    """``None`` if ``forward(probe)`` equals the chained layers, else how they differ."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    devices |= {
        t.device for t in (probe if isinstance(probe, tuple) else (probe,)) if isinstance(t, torch.Tensor)
    }
    if any(d.type == "meta" for d in devices):
        raise _UncheckedError(
            "this rank holds only its own stage (the model was built on the meta device), so forward "
            "cannot run here; if forward does more than chain the layers, the pipeline skips it: check "
            "it once on one device"
        )
    if len(devices) > 1:
        raise _UncheckedError(f"the model's tensors are on several devices ({sorted(map(str, devices))})")
    with torch.no_grad():
        try:
            with skip_scope():  # a forward calling layers that stash and pop
                expected = _call(forward, probe)
        except NotImplementedError:
            raise
        except Exception as err:
            raise _UncheckedError(f"forward raised {type(err).__name__}: {err}") from err
        with skip_scope():  # the chain's skips, as the pipeline passes them
            chained = apply_layers(layers, probe)
    return _difference(expected, chained)


def _difference(expected: Any, chained: Any) -> str | None:
    exp = expected if isinstance(expected, tuple | list) else (expected,)
    got = chained if isinstance(chained, tuple) else (chained,)
    if len(exp) != len(got) or not all(isinstance(t, torch.Tensor) for t in exp):
        return (
            f"forward returns {type(expected).__name__} of {len(exp)} items, the chained layers "
            f"{len(got)} tensor(s)"
        )
    for k, (a, b) in enumerate(zip(exp, got, strict=True)):
        if a.shape != b.shape:
            return f"output {k} of forward has shape {tuple(a.shape)}, the chained layers' {tuple(b.shape)}"
        if not torch.allclose(a.double(), b.double(), rtol=_RTOL, atol=_ATOL, equal_nan=True):
            gap = float((a.double() - b.double()).abs().nan_to_num().max())
            return f"output {k} of forward differs from the chained layers' by up to {gap:.3g}"
    return None


def check_forward(
    forward: Callable[..., Any], layers: Sequence[nn.Module], model: nn.Module, probe: Any
) -> tuple[str | None, str | None]:
    """Compare ``forward`` with the chain of ``layers`` on ``probe``.

    Returns ``(error, warning)``: an error message when ``forward`` is shown to differ, a warning
    when it could not be checked, ``(None, None)`` when it is the chain. A ``forward`` that is not
    implemented passes: it cannot be served, so it cannot silently differ.
    """
    # Eval mode throughout: it is what a served model runs, and training-mode side effects (a
    # BatchNorm accumulating statistics, dropout drawing numbers) must not see the probe.
    try:
        with evaluating(model):
            structural = _structural(forward, layers, probe)
            numeric = None if structural is None else _numeric(forward, layers, model, probe)
    except NotImplementedError:
        return None, None
    except _UncheckedError as why:
        return None, (
            f"pipe_tp could not check that {type(model).__name__}.forward equals its pipeline layers "
            f"applied in order ({structural}; a numeric comparison was not possible: {why}). Once you have "
            "checked it (on one device, say), PipeTPStrategy(check_forward=False) skips the check and this "
            "warning."
        )
    if numeric is None:
        return None, None
    return (
        f"{type(model).__name__}.forward is not its configure_pipeline() layers applied in order: "
        f"{structural}, and {numeric}. Under pipe_tp, self(...) in a step returns the output of the "
        "layers chained (a tuple output becomes the next layer's positional arguments), so logic in "
        "forward outside the layers (a residual around them, a final activation, a change of the "
        "input) would be skipped in training, and a checkpoint served with forward would run another "
        "model. Move that logic into a layer (e.g. a final layer that applies the activation), so "
        "that forward is exactly `for layer in layers: x = layer(x)`."
    ), None
