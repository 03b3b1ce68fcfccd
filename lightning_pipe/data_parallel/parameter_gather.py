"""ZeRO-1's all-gather of the updated parameters, overlapped with the next forward.

After ``optimizer.step()`` each data-parallel replica has updated only its slices of the gradient
buckets (:mod:`.sharded_optimizer`); the other replicas' slices must reach every parameter before
anything reads it. As in Megatron-Core's distributed optimizer (``overlap_param_gather``):

* **In place.** The parameters of a bucket become views of one flat *parameter* buffer with the
  gradient bucket's offsets (and padding), so this replica's slice of that buffer is what its
  optimizer steps, and the all-gather writes every replica's slice straight into the parameters:
  no staging copy, no copy-out, no zeroing afterwards, no new memory (the parameters' old storage
  is freed when they move in).
* **Overlapped.** The step's post-hook only *launches* the gathers, in the order the forward uses
  the buckets, and returns. A forward pre-hook on each pipeline layer waits for that layer's
  buckets only, so the first layers compute while the last ones' gathers are still in flight.
* **Guarded.** Between the step and the next forward, Lightning's glue runs user code (a
  callback's ``on_train_batch_end``, logging, validation). Until the first layer's pre-hook, a
  :class:`~torch.overrides.TorchFunctionMode` watches every torch call: one that is given a
  parameter whose gather is pending (``.detach()``, ``.clone()``, ``state_dict()``, arithmetic,
  ``torch.save``) first waits for all gathers. Reading metadata (``.grad``, ``.shape``,
  ``.data_ptr()``) does not. The guard goes to the *bottom* of the mode stack (above a
  ``torch.set_default_device`` context, as torch's own ``DeviceContext`` does), so that a user's
  ``with SomeMode():`` around the step pops its own mode on exit, not the guard; it is taken out
  of wherever it sits when the gathers are done. The strategy adds explicit waits where Lightning
  leaves the loop (end of training, evaluation, checkpoint saves). Not seen: a view or alias made
  *before* the step and read after it (``self.ref = p.detach()`` kept by a callback: the guard
  knows the parameters, not their aliases), and any read from *another Python thread* (torch's
  mode stack is per thread): call :meth:`ParameterGather.wait_all` (the strategy's
  ``runtime.wait_for_parameters()``) first; it is safe from any thread (one lock orders the
  waits, so the training thread's forward and another thread's wait never see a half-waited
  bucket; while that wait holds it, the forward waits for every bucket: no overlap for that
  step). While the guard is on, every torch call of this thread goes through its Python
  handler (the next batch's transfer and split, a few dozen calls), and a call outside its list
  of metadata reads that is given a parameter ends that step's overlap (it waits for all).
* **Ordered.** A second ``optimizer.step()`` before the first's gathers are waited for (no forward
  in between) would write this replica's slices while the in-flight gather still copies them into
  its own chunk of the buffer, losing part of the update: the step's pre-hook waits first (after
  the step's closure when it has one, which holds the forward that overlaps them).
* **After a failure.** :meth:`ParameterGather.abandon` waits for nothing, but forgets nothing: a
  later forward, save or guarded read waits for the gathers still in flight (within the group's
  timeout), and a gather that cannot complete (its wait raised, or it was still incomplete after
  :meth:`ParameterGather.close`'s grace: a peer is gone) makes every later wait raise
  :class:`TornParametersError` instead of letting a save or a step read half-gathered weights.

``overlap=False`` waits in the post-hook itself (a blocking gather, still in place).

The parameters must stay views of their buffer: anything that replaces ``param.data`` later
(``load_state_dict(..., assign=True)``, ``model.half()``, moving the model to another device)
would cut them off from the updates. That is checked before every step and gather, and refused by
name (:class:`ParameterAliasingError`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C import _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode, _push_mode
from torch.utils._device import DeviceContext
from torch.utils.hooks import RemovableHandle

from lightning_pipe.collectives import all_gather_flat
from lightning_pipe.data_parallel.reducer import BucketLayout

_METADATA: frozenset[Any] = frozenset(
    {
        getattr(torch.Tensor, name).__get__
        for name in (
            "grad",
            "requires_grad",
            "shape",
            "dtype",
            "device",
            "ndim",
            "is_leaf",
            "grad_fn",
            "layout",
            "is_cuda",
            "is_meta",
            "is_sparse",
            "nbytes",
            "itemsize",
        )
    }
    | {vars(torch._C.TensorBase)[name].__set__ for name in ("grad", "requires_grad")}
    | {
        getattr(torch.Tensor, name)
        for name in (
            "size",
            "dim",
            "numel",
            "data_ptr",
            "element_size",
            "stride",
            "storage_offset",
            "is_contiguous",
            "requires_grad_",
            "is_floating_point",
            "get_device",
            "__len__",
        )
    }
)
"""Torch calls that read a tensor's metadata, never its values: a guarded parameter may be given
to them without waiting (the reducer and ``zero_grad`` read and set ``.grad`` in the window;
freezing a layer, as Lightning's ``BaseFinetuning`` does, only sets a flag). Hashing a tensor
never reaches a torch-function mode (it is ``id``)."""

_CLOSE_GRACE = timedelta(seconds=5)
"""How long :meth:`ParameterGather.close` after :meth:`~ParameterGather.abandon` lets the gathers
still in flight complete (they do when every peer is alive) before it calls them torn."""


def _no_wait(layer: nn.Module, args: Any) -> None:
    """The forward pre-hook of a copied layer: a copy's parameters are not in any bucket."""


class _ForwardWait:
    """A layer's forward pre-hook waiting for its buckets' gathers. Copied (``copy.deepcopy`` of a
    layer after setup: an EMA or teacher copy) or pickled, it becomes :func:`_no_wait`: the copy's
    parameters are its own tensors, not views of the buffers, and a process group cannot be copied."""

    def __init__(self, gather: ParameterGather) -> None:
        self.gather = gather

    def __call__(self, layer: nn.Module, args: Any) -> None:
        self.gather._before_forward(layer, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[[nn.Module, Any], None]:
        return _no_wait

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert, ())


def _inert() -> Callable[[nn.Module, Any], None]:
    return _no_wait


class ParameterAliasingError(RuntimeError):
    """A ZeRO-1 parameter no longer lives in its bucket's flat parameter buffer."""


class TornParametersError(RuntimeError):
    """Some buckets' all-gather did not complete: their parameters hold a mix of this step's and
    older slices, and must not be read, saved or stepped."""


@dataclass
class GatherRecord:
    """What the gathers did, for tests and profiles (counts, no timings)."""

    launches: int = 0
    """Steps whose updated slices were gathered."""
    pending_at_first_forward: list[int] = field(default_factory=list)
    """Per launch that a forward met: buckets still not waited for when the first pipeline
    layer's pre-hook ran (more than 0: that forward started before their gathers were waited)."""
    reads_caught: int = 0
    """Torch calls between a step and the next forward that read a pending parameter, and waited."""


class _ReadGuard(TorchFunctionMode):
    """Waits for every pending gather before a torch call that is given a watched parameter."""

    def __init__(self, watched: set[int], on_read: Callable[[], None]) -> None:
        super().__init__()
        self.watched = watched
        self.on_read = on_read
        self.active = False
        self.handling = 0
        """Depth of :meth:`__torch_function__` calls: torch takes a mode off the stack while its
        handler runs, so there the guard's absence from the stack does not mean it was removed."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.handling += 1
        try:
            if self.active and func not in _METADATA and self._reads_watched(args, kwargs):
                self.on_read()
        finally:
            self.handling -= 1
        return func(*args, **kwargs)

    def on_stack(self) -> bool:
        """Whether the guard is on this thread's torch-function mode stack (wherever: a user's mode
        may have been pushed above it, or one of ours popped by someone else's exit)."""
        return any(mode is self for mode in _get_current_function_mode_stack())

    def insert(self) -> None:
        """Push the guard under every mode but a ``torch.set_default_device`` context (whose exit
        expects to be at the very bottom): a mode entered before the step and exited after it
        then pops itself, not the guard. Retired guards of other gathers still on the stack (their
        own thread's wait never came: a teardown left them to another thread's wait) are dropped
        on the way: they do nothing, yet every torch call of this thread would go through them."""
        above = [
            mode
            for mode in (_pop_mode() for _ in range(_len_torch_function_stack()))  # top first
            if not (isinstance(mode, _ReadGuard) and mode is not self and not mode.active)
        ]
        while above and isinstance(above[-1], DeviceContext):
            _push_mode(above.pop())
        _push_mode(self)
        for mode in reversed(above):
            _push_mode(mode)

    def remove(self) -> bool:
        """Take the guard out of the mode stack wherever it sits, keeping the others' order;
        ``False`` when it is not there (inside its own handler: torch pushes it back after)."""
        modes = _get_current_function_mode_stack()
        if not any(mode is self for mode in modes):
            return False
        above = []
        while (mode := _pop_mode()) is not self:
            above.append(mode)
        for mode in reversed(above):
            _push_mode(mode)
        return True

    def _reads_watched(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        # The call's own arguments and one level of lists (torch.cat, the foreach functions):
        # deeper structures reach torch as such lists anyway, element by element.
        for value in (*args, *kwargs.values()):
            if id(value) in self.watched:
                return True
            if isinstance(value, list | tuple) and any(id(v) in self.watched for v in value):
                return True
        return False


class ParameterGather:
    """The parameter buffers of a ZeRO-1 :class:`~.reducer.BucketLayout` and their gathers.

    Args:
        layout: the sharding reducer's buckets; their parameters move into flat buffers here.
        overlap: launch the gathers and return (waited by the forward, the guard or
            :meth:`wait_all`); ``False``: wait for them at once.
        names: parameter names by ``id()``, for the error messages.
        naming: names the operation in a failing collective's error.
    """

    def __init__(
        self,
        layout: BucketLayout,
        overlap: bool = True,
        names: Mapping[int, str] | None = None,
        naming: Callable[[str], AbstractContextManager[None]] = lambda what: nullcontext(),
    ) -> None:
        self.layout, self.overlap, self._naming = layout, overlap, naming
        self._names = dict(names or {})
        self.buffers: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        """This replica's slice of each parameter buffer: what its optimizer steps."""
        for bucket in layout.buckets:
            buffer = torch.zeros_like(bucket.buffer)
            for param, offset in bucket.params:
                view = buffer[offset : offset + param.numel()].view_as(param)
                view.copy_(param.detach())
                param.data = view  # the old storage is freed: no second copy of the weights
            self.buffers.append(buffer)
            self.shards.append(buffer[bucket.shard_range.start : bucket.shard_range.stop])
        self._lock = threading.RLock()
        """Held by every wait, launch and close: another thread's :meth:`wait_all` (the documented
        way to read weights from a thread) and the training thread's forward then never meet a
        bucket half-waited by the other."""
        self._pending: dict[int, dist.Work] = {}
        self._retired: list[dist.Work] = []
        self._retired_earlier: list[dist.Work] = []
        """Works waited for (or dropped) since the last launch, and before it: each is kept referenced
        until the launch after the next one. ``wait()`` returns when gloo's worker thread marks a work
        complete, before that thread lets go of it. Dropped at once, a work is then destroyed on the
        worker thread, which needs the GIL; when the process ends right after (the last step's gathers
        are waited just before the end), the interpreter is finalizing by then and the thread's forced
        exit aborts it (pytorch/pytorch#190489, as :func:`lightning_pipe.mesh.init_mesh`'s exit
        handler describes; that grace covers processes whose mesh we built, this covers every caller:
        9 of 24 two-rank engine launches aborted without it, 0 of 24 with it)."""
        self._order: list[int] = list(reversed(range(len(layout.buckets))))
        """Launch order: the forward's (a reducer's first buckets hold the last layers)."""
        self._layer_buckets: dict[int, tuple[int, ...]] = {}
        self._unwatched: tuple[int, ...] = ()
        self._hooks: list[RemovableHandle] = []
        self._first_forward = False
        self._guarded = False
        """The guard may be on the mode stack (a hint for the fast paths; the stack decides)."""
        self._guard_thread: int | None = None
        """The thread whose mode stack holds the guard (modes are per thread): only it removes it."""
        self._abandoned = False
        self._torn: set[int] = set()
        """Buckets whose gather was launched and did not complete (its wait raised, or it was still
        incomplete when :meth:`close`'s grace ran out)."""
        self._guard = _ReadGuard({id(p) for b in layout.buckets for p, _ in b.params}, self._read_caught)
        self.record = GatherRecord()

    # ------------------------------------------------------------------ set-up
    def watch(self, layers: Sequence[nn.Module]) -> None:
        """Wait in a forward pre-hook of each of ``layers`` (in forward order) for the buckets of
        its parameters, and launch the gathers in the order these layers first use them."""
        where = {id(p): k for k, b in enumerate(self.layout.buckets) for p, _ in b.params}
        first_use: dict[int, int] = {}
        for position, layer in enumerate(layers):
            buckets = tuple(sorted({where[id(p)] for p in layer.parameters() if id(p) in where}))
            self._layer_buckets[id(layer)] = buckets
            for k in buckets:
                first_use.setdefault(k, position)
            self._hooks.append(layer.register_forward_pre_hook(_ForwardWait(self)))
        # Buckets no watched layer uses (an engine-level caller watching some layers only; in the
        # strategy every bucketed parameter is in a watched layer): first, and waited by the first
        # layer's hook.
        self._unwatched = tuple(k for k in range(len(self.layout.buckets)) if k not in first_use)
        self._order = list(self._unwatched) + sorted(first_use, key=lambda k: (first_use[k], -k))

    def close(self) -> None:
        """Wait for what is in flight and remove the forward pre-hooks. After :meth:`abandon`, give
        the gathers in flight a few seconds (:data:`_CLOSE_GRACE`: they complete when every peer is
        alive) and call the rest torn; when another thread is waiting for them, leave them to
        that wait. The optimizer's step hooks stay: a step after this still gathers what it
        updated, as the replicas need."""
        try:
            if not self._abandoned:
                self.wait_all()
            # Another thread may hold the lock in an untimed wait (a background reader's
            # wait_for_parameters()): the grace bounds the teardown, and that wait itself marks
            # its bucket torn if its gather fails.
            elif self._lock.acquire(timeout=_CLOSE_GRACE.total_seconds()):
                try:
                    self._wait_with_grace()
                    self._retire_guard()
                finally:
                    self._lock.release()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()

    def _wait_with_grace(self) -> None:
        deadline = time.monotonic() + _CLOSE_GRACE.total_seconds()
        for k in list(self._order):
            work = self._pending.get(k)
            if work is None:
                continue
            left = deadline - time.monotonic()
            completed = False
            try:
                # A work that failed (its peer gone) is completed too: its wait, at once, raises.
                # A zero timeout means "none" to c10d (and under 1 ms is truncated to it): out of
                # time, a work only counts if it has completed, and well.
                if work.is_completed() or left > 0.01:
                    work.wait(timedelta(seconds=max(left, 0.01)))
                    completed = True
            except Exception:  # the peer is gone, or the time is up: what it says is not needed
                pass
            if not completed:
                self._torn.add(k)
            self._forget(k, work)

    # ------------------------------------------------------------------ one step
    def check_aliasing(self) -> None:
        """Refuse a parameter that no longer lives in its bucket's buffer (its updates would be lost)."""
        for bucket, buffer in zip(self.layout.buckets, self.buffers, strict=True):
            base, size = buffer.data_ptr(), buffer.element_size()
            for param, offset in bucket.params:
                if param.data_ptr() != base + offset * size or param.dtype != buffer.dtype:
                    name = self._names.get(id(param), f"of shape {tuple(param.shape)}")
                    raise ParameterAliasingError(
                        f"shard_optimizer_state=True keeps parameter {name} as a view of its gradient "
                        "bucket's flat parameter buffer, which the optimizer steps and the replicas' "
                        "all-gather fills; its storage was replaced after the optimizer was set up "
                        "(param.data = ..., load_state_dict(..., assign=True), model.half() or moving the "
                        "model to another device), so it would no longer see the updates. Copy new values "
                        "into it instead (param.data.copy_(...), load_state_dict without assign=True), or "
                        "convert and move the model before the optimizer is built."
                    )

    def launch(self) -> None:
        """Gather every replica's updated slices into the parameters (after the optimizer's step):
        launched in forward order; with ``overlap``, waited later."""
        self.check_aliasing()
        with self._lock:
            # The step's pre-hook has waited for the previous gathers (see the module's docstring);
            # a direct call too must wait once for every launched work.
            self.wait_all()
            # Works retired before the previous launch: a whole step ago, their threads are done
            # (those just waited, by the line above say, are kept one launch more).
            self._retired_earlier, self._retired = self._retired, []
            with self._naming("all-gathering the updated parameters over the data-parallel group"):
                for k in self._order:
                    self._pending[k] = all_gather_flat(
                        self.buffers[k], self.shards[k], group=self.layout.group_of(k), async_op=True
                    )
            self.record.launches += 1
            if not self.overlap:
                self.wait_all()
                return
            self._first_forward = True
            self._guard.active = True
            # Asked of the stack, not of a flag of ours: someone else's exit may have popped the guard.
            if not self._guard.on_stack():
                self._guard.insert()
            self._guarded = True
            self._guard_thread = threading.get_ident()

    @property
    def pending(self) -> bool:
        """Whether some gather has not been waited for."""
        return bool(self._pending)

    def wait(self, buckets: Iterable[int]) -> None:
        """Wait for the gathers of ``buckets`` (those launched and not yet waited for); raise
        :class:`TornParametersError` if some bucket's gather could not complete."""
        with self._lock:
            self._raise_if_torn()
            with self._naming("all-gathering the updated parameters over the data-parallel group"):
                for k in buckets:
                    work = self._pending.get(k)
                    if work is None:
                        continue
                    # Pending until its wait has returned: under the lock, no other thread sees it
                    # gone while its parameters are still being written. An interrupt (Ctrl-C)
                    # leaves it pending: gloo's wait cannot be interrupted, the signal is handled
                    # after it returned, and the gather completes anyway.
                    try:
                        work.wait()
                    except Exception:
                        self._torn.add(k)  # its parameters hold a mix of slices from now on
                        self._forget(k, work)
                        raise
                    self._forget(k, work)
            if not self._pending:
                self._first_forward = False  # waited before any forward (a read, a save, the end)
                self._retire_guard()

    def _forget(self, k: int, work: dist.Work) -> None:
        # A signal handler on this thread (a save from Lightning's SIGUSR1 requeue) may have
        # waited for the same work in between: it is then gone already.
        if self._pending.get(k) is work:
            del self._pending[k]
            self._retired.append(work)

    def wait_all(self) -> None:
        """Wait for every gather in flight: after it, every parameter holds its full updated value."""
        if not self._pending and not self._guarded and not self._torn:  # the usual case: one test
            return
        with self._lock:
            self.wait(list(self._order))
            self._retire_guard()

    def abandon(self) -> None:
        """After an exception: wait for nothing now (a peer may be gone, and a wait could last the
        whole timeout), but forget nothing. A later forward, save or guarded read waits for the
        gathers still in flight (within the group's timeout); one whose wait fails, or that
        :meth:`close` finds still incomplete after its grace (a peer is gone), leaves its buckets
        torn, and every later wait of this object raises :class:`TornParametersError` rather than
        let anything read them. (A ``validate`` after a failed ``fit`` builds a new runtime, which
        does not know: with a peer gone, its own collectives fail then.)"""
        self._abandoned = True

    def _raise_if_torn(self) -> None:
        if not self._torn:
            return
        names = [
            self._names.get(id(param), f"of shape {tuple(param.shape)}")
            for k in sorted(self._torn)
            for param, _ in self.layout.buckets[k].params
        ]
        raise TornParametersError(
            f"ZeRO-1's all-gather of the updated parameters did not complete for {len(self._torn)} "
            f"bucket(s) after an earlier failure (parameters {', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''}): they hold this replica's updated slices beside other "
            "replicas' older ones, so they cannot be read, saved or stepped. Restart from a checkpoint."
        )

    # ------------------------------------------------------------------ waiting
    def _before_forward(self, layer: nn.Module, args: Any) -> None:
        if not self._pending and not self._guarded and not self._torn:  # between forwards: three tests
            return
        with self._lock:
            self._retire_guard()  # the forward is covered by the pre-hooks from here on
            if self._first_forward:
                self._first_forward = False
                self.record.pending_at_first_forward.append(len(self._pending))
                self.wait(self._unwatched)
            self.wait(self._layer_buckets.get(id(layer), ()))

    def _read_caught(self) -> None:
        self.record.reads_caught += 1
        self.wait_all()

    def _retire_guard(self) -> None:
        """Stop guarding and take the guard off the torch-function mode stack, wherever it sits.
        Inside its own handler torch has taken it off and pushes it back after, and another thread
        cannot reach the guard's thread's stack: it stays, inert, and that thread's next forward
        or wait removes it."""
        self._guard.active = False
        if (
            self._guarded
            and threading.get_ident() == self._guard_thread
            and (self._guard.remove() or not self._guard.handling)
        ):
            self._guarded = False
