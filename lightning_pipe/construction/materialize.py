"""Give this rank's meta tensors storage and initial values that do not depend on the layout.

Each module with meta tensors is initialised on the CPU, from a random stream of its own seeded by
the run's seed and the module's qualified name, by its ``reset_parameters()`` (Lightning's
convention for meta-device models) or by a function the caller passes (the LightningModule's
``init_module_weights(module)``); its values then move to the device. A module's values depend only
on (seed, name), never on which rank builds it or what else that rank builds, so one process,
pp=4, pp=2 x tp=2 and dp=2 x pp=2 start from bit-identical weights, and tensor and data-parallel
peers agree without a byte of communication. The generator is the CPU's whatever the device: the
same weights on a laptop and on a GPU node.

A tensor-parallel module cut from a meta module (:mod:`lightning_pipe.tensor_parallel.sources`)
initialises that full
module on the CPU and keeps only its slice: the full layer exists once, on the host, for as long as
one module's initialisation takes, and the device only ever allocates the slice (Megatron's
``use_cpu_initialization`` path does the same, so that a slice equals the same slice of the full
layer).

A tensor shared by several modules (a tied embedding and output head) belongs to the first module
that holds it in ``named_modules()`` order and is initialised by that module alone, on every rank
that holds a copy: a rank whose stage has the head but not the embedding still gives the head the
embedding's values. A float tensor that the initialisation leaves unset (its module has no
``reset_parameters()``, or that method misses it) is an error naming it: it is filled with NaN
beforehand, so an omission cannot pass as a value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe.construction.pretrained import WeightFiles
from lightning_pipe.experts.shard import held_block
from lightning_pipe.tensor_parallel.sources import source_of

_SHOWN = 8

InitFn = Callable[[nn.Module], None]
"""Initialises a module's own (direct) parameters and buffers in place."""


class MaterializeError(RuntimeError):
    """Some tensors of a meta-built model got no initial value."""


def module_seed(seed: int, name: str) -> int:
    """The seed of the module called ``name``'s own random stream (63 bits)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class Materialized:
    """What :func:`materialize` created."""

    tensors: frozenset[int]
    """``id()`` of every tensor created (parameters and buffers)."""
    elements: int
    """Their number of elements."""


def _direct(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """A module's own tensors: (attribute, tensor, is_parameter)."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield attr, p, True
    for attr, b in module._buffers.items():
        if b is not None:
            yield attr, b, False


def _set(module: nn.Module, attr: str, value: torch.Tensor, is_param: bool) -> None:
    (module._parameters if is_param else module._buffers)[attr] = value  # type: ignore[assignment]


def _blank(meta: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like ``meta``: NaN for floats (so that a missed one shows), else zeros."""
    if meta.is_floating_point() or meta.is_complex():
        return torch.full(meta.shape, float("nan"), dtype=meta.dtype)
    return torch.zeros(meta.shape, dtype=meta.dtype)


@contextmanager
def _stream(seed: int) -> Iterator[None]:
    # Only the CPU generator is touched (torch.manual_seed would reseed every CUDA device too),
    # and the caller's stream is restored: dropout and data order do not depend on the layout.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _initialise(module: nn.Module, name: str, seed: int, init: InitFn | None) -> dict[str, torch.Tensor]:
    """The initial values (on the CPU) of ``module``'s own meta tensors, by attribute."""
    metas = [(attr, t, is_param) for attr, t, is_param in _direct(module) if t.is_meta]
    # An init rewrites every tensor of the module, the real ones too (a buffer set after
    # construction, an eagerly built parameter): those keep their values.
    real = [(attr, t.detach().clone()) for attr, t, _ in _direct(module) if not t.is_meta]
    for attr, t, is_param in metas:
        blank: torch.Tensor = _blank(t)
        if is_param:
            blank = nn.Parameter(blank, t.requires_grad)
            blank.__dict__.update(t.__dict__)  # attributes an init may read (sharding marks)
        _set(module, attr, blank, is_param)
    try:
        with _stream(module_seed(seed, name)), torch.no_grad():
            if init is not None:
                init(module)
            elif callable(reset := getattr(module, "reset_parameters", None)):
                reset()
        # Read back what the attributes hold now: an init may assign new tensors (litgpt's
        # ``self.cos, self.sin = self.rope_cache()``) instead of filling the given ones.
        current = dict((attr, t) for attr, t, _ in _direct(module))
        with torch.no_grad():
            for attr, kept in real:
                if attr in current and current[attr].shape == kept.shape:
                    current[attr].copy_(kept)
        return {attr: current[attr].detach().to("cpu") for attr, _, _ in metas}
    finally:
        for attr, t, is_param in metas:  # the module stays meta until the caller swaps in values
            _set(module, attr, t, is_param)


class _Values:
    """Initial values of meta tensors, each defined by the first module holding it.

    Holders are registered in ``named_modules()`` order; a tensor-parallel module registers the
    full module it was cut from (its source) first, under the same name, so that a slice's full
    tensor is still found, and owned, where the unsharded model had it: a head tied to an
    embedding that another rank holds still takes the embedding's values.
    """

    def __init__(
        self, model: nn.Module, seed: int, init: InitFn | None, weights: WeightFiles | None = None
    ) -> None:
        self.seed, self.init, self.weights = seed, init, weights
        self.owners: dict[int, tuple[str, nn.Module, str]] = {}
        # Every state-dict key that reaches a meta tensor: a file may hold a tied weight under
        # either name (Hugging Face keeps only the embedding's).
        self.keys: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            source = source_of(module)
            for holder in (source[0], module) if source is not None else (module,):
                for attr, t, _ in _direct(holder):
                    if t.is_meta:
                        self.owners.setdefault(id(t), (name, holder, attr))
                        self.keys.setdefault(id(t), []).append(f"{name}.{attr}" if name else attr)
        self._memo: dict[int, dict[str, torch.Tensor]] = {}
        self.missing: list[str] = []
        """Parameters the weight files do not hold (they are initialised instead)."""

    def _read(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor``'s value from the weight files, cast to its dtype, or ``None``."""
        assert self.weights is not None
        for key in self.keys[id(tensor)]:
            value = self.weights.get(key, held_block(tensor))
            if value is None:
                continue
            if tuple(value.shape) != tuple(tensor.shape):
                raise MaterializeError(
                    f"The pretrained weights {self.weights.path} hold {key!r} (as "
                    f"{self.weights.file_key(key)!r}) with shape {list(value.shape)}, but the model's is "
                    f"{list(tensor.shape)}: the files belong to another configuration of the model."
                )
            return value.to(tensor.dtype)
        return None

    def _loaded_or_initialised(self, module: nn.Module, name: str) -> dict[str, torch.Tensor]:
        if self.weights is None:
            return _initialise(module, name, self.seed, self.init)
        metas = [(attr, t, is_param) for attr, t, is_param in _direct(module) if t.is_meta]
        loaded = {attr: v for attr, t, _ in metas if (v := self._read(t)) is not None}
        for attr, t, is_param in metas:
            if is_param and attr not in loaded:
                self.missing.append(self.keys[id(t)][0])
        if len(loaded) == len(metas):
            return loaded  # nothing to initialise: the files hold every tensor
        values = _initialise(module, name, self.seed, self.init)
        values.update(loaded)
        return values

    def _expert_blocks(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The values of a module cut to a block of experts (every tensor it holds marked with
        its :class:`~lightning_pipe.experts.shard.ExpertShard`), each read as that block from the
        weight files; ``None`` when a tensor is not such a block or the files lack one (the full
        layer is then made and cut, as any cut module's)."""
        if self.weights is None:
            return None
        metas = [(attr, t) for attr, t, _ in _direct(module) if t.is_meta]
        if not metas or any(held_block(t) is None for _, t in metas):
            return None
        values = {}
        for attr, t in metas:
            value = self._read(t)
            if value is None:
                return None
            values[attr] = value
        return values

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The initial value of ``tensor`` (on the CPU)."""
        name, holder, attr = self.owners[id(tensor)]
        return self._of_module(holder, name)[attr]

    def forget(self) -> None:
        """Drop remembered values: at most one module's full values are kept at a time."""
        self._memo.clear()

    def _of_module(self, module: nn.Module, name: str) -> dict[str, torch.Tensor]:
        if id(module) in self._memo:
            return self._memo[id(module)]
        source = source_of(module)
        blocks = self._expert_blocks(module) if source is not None else None
        if blocks is not None:
            values = blocks  # the files hold this rank's experts: read those, not the full layer
        elif source is None or not any(t.is_meta for _, t, _ in _direct(source[0])):
            values = self._loaded_or_initialised(module, name)
        else:
            # The full layer's values (each full tensor from its own owner), then the same cut.
            full, build = source
            metas = [(attr, t, is_param) for attr, t, is_param in _direct(full) if t.is_meta]
            # All values first: initialising ``full`` for one of them must find it still meta
            # (an initialised tensor put back would be overwritten in place by the next init).
            full_values = {attr: self.of(t) for attr, t, _ in metas}
            for attr, t, is_param in metas:
                value = full_values[attr]
                _set(full, attr, nn.Parameter(value, t.requires_grad) if is_param else value, is_param)
            try:
                built = build(full)
            finally:
                for attr, t, is_param in metas:
                    _set(full, attr, t, is_param)
            values = {attr: t.detach() for attr, t, _ in _direct(built)}
        self._memo[id(module)] = values
        return values


def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    skip: Set[int],
    init: InitFn | None = None,
    weights: WeightFiles | None = None,
) -> Materialized:
    """Give every meta tensor of ``model`` whose ``id()`` is not in ``skip`` storage on ``device``
    and its layout-independent initial value (from ``weights`` when they hold it); every attribute
    that held the meta tensor (a tied weight is held twice) then holds the new one.

    With ``weights``, a parameter the files do not hold is an error naming it (buffers the files
    lack, usually computed ones, are initialised).

    Raises :class:`MaterializeError` naming the float tensors that the initialisation left unset.
    """
    values = _Values(model, seed, init, weights)
    created: dict[int, torch.Tensor] = {}
    unset: list[str] = []
    for name, module in model.named_modules():
        for attr, t, is_param in _direct(module):
            if not t.is_meta or id(t) in skip or id(t) in created:
                continue
            value = values.of(t)
            if (value.is_floating_point() or value.is_complex()) and bool(value.isnan().any()):
                unset.append(f"{name}.{attr}" if name else attr)
            value = value.to(device)
            if is_param:
                param = nn.Parameter(value, requires_grad=t.requires_grad)
                param.__dict__.update(t.__dict__)  # sharding marks travel with the parameter
                value = param
            created[id(t)] = value
        values.forget()
    if values.missing:
        missing = sorted(set(values.missing))
        assert weights is not None
        raise MaterializeError(
            f"The pretrained weights {weights.path} hold no value for {len(missing)} parameters of this "
            f"rank's stage: {missing[:_SHOWN]}{' ...' if len(missing) > _SHOWN else ''}. If the files name "
            f"them without the module's prefix, pass it (pretrained_prefix, now {weights.prefix!r}: a "
            "Hugging Face model kept as self.llama takes 'llama.')."
        )
    if unset:
        raise MaterializeError(
            f"The meta-built model has {len(unset)} tensor{'s' if len(unset) != 1 else ''} that no "
            f"initialisation set: {unset[:_SHOWN]}"
            f"{' ...' if len(unset) > _SHOWN else ''}. Under pipe_tp, a model built in configure_model() "
            "or under trainer.init_module(empty_init=True) has its parameters on the meta device, and each "
            "rank initialises the modules of its own stage with their reset_parameters() (Lightning's "
            "convention). Give those modules a reset_parameters() that sets every parameter and buffer "
            "they hold directly, or define init_module_weights(self, module) on the LightningModule to "
            "initialise any module (e.g. by calling a Hugging Face model's _init_weights(module))."
        )
    _replace(model, created)
    # A module that still holds the full meta tensor a materialised slice was cut from (an output
    # head tied to the embedding, on the embedding's stage, outside this stage's layers) holds the
    # slice now: its state-dict key then saves and loads this rank's current values.
    cut: dict[int, torch.Tensor] = {}
    for module in model.modules():
        source = source_of(module)
        if source is None:
            continue
        for attr, full, _ in _direct(source[0]):
            mine = module._parameters.get(attr)
            if full.is_meta and mine is not None and not mine.is_meta:
                cut.setdefault(id(full), mine)
    _replace(model, cut)
    return Materialized(frozenset(id(t) for t in created.values()), sum(t.numel() for t in created.values()))


def release(model: nn.Module, tensors: Set[int]) -> int:
    """Replace the tensors of ``model`` whose ``id()`` is in ``tensors`` by meta twins (storage
    freed); returns the number of elements released."""
    twins: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for _, t, is_param in _direct(module):
            if id(t) in tensors and not t.is_meta and id(t) not in twins:
                twin = torch.empty_like(t, device="meta")
                if is_param:
                    param = nn.Parameter(twin, requires_grad=t.requires_grad)
                    param.__dict__.update(t.__dict__)
                    twin = param
                twins[id(t)] = twin
    _replace(model, twins)
    return sum(t.numel() for t in twins.values())


def _replace(model: nn.Module, new: dict[int, torch.Tensor]) -> None:
    for module in model.modules():
        for attr, t, is_param in list(_direct(module)):
            if id(t) in new:
                _set(module, attr, new[id(t)], is_param)
