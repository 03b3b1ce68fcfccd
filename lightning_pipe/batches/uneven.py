"""Every rank stops at the same batch, even when data-parallel replicas hold different amounts.

A replica whose data stream is shorter than the others' leaves the loop while they start one more
step and wait in its gradient all-reduce until the deadline. torch's ``Join``
solves this for DDP by shadowing the missing collectives; a pipeline has too many (every stage's
exchanges, the tensor-parallel reductions), so the ranks decide *before* the step instead: as each
rank fetches a batch, one small all-reduce over every rank says whether all of them got one.

* All have a batch: the step runs. None has: the loop ends, as it would on one device.
* Some data-parallel replicas ran out: every rank ends the loop there and the longer replicas'
  remaining batches are skipped, with a warning that names the replicas (the choice ``DistributedSampler``
  with ``drop_last`` makes: stop at the shorter length).
* Ranks of one replica disagree: they loaded different data, a defect the pipeline cannot run
  with; every rank raises :class:`~lightning_pipe.batches.agreement.StepCheckError`.

Because the decision is made inside ``next()``, where every rank is at the same point of the
loop, it cannot interleave with the other collectives of the loop (logging, callbacks), as an
agreement at the end of the loop would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.batches.agreement import SAME_DATA_FIX, StepCheckError
from lightning_pipe.mesh import ParallelLayout

_OWN = ("_loader", "_layout", "_group", "_device", "_what", "_warn", "_naming", "_length")


class EvenBatches:
    """An iterable over ``loader`` whose iterators stop at the same batch on every rank of ``group``.

    Attributes other than its own are those of ``loader`` (``dataset``, ``sampler``,
    ``batch_size``, ...), so code that inspects a dataloader keeps working.

    Args:
        loader: what the rank iterates (a ``DataLoader`` or any iterable).
        layout: maps the global ranks of ``group`` to their replicas (``group`` spans the world).
        group: every rank of the layout; the agreement is one all-reduce over it per batch.
        device: where the agreement's tensors live (the rank's device, for NCCL).
        what: what the batches are, for messages ("train batches").
        warn: shows the warning about skipped batches (called on every rank; the caller decides
            which rank prints it).
        naming: a context that names this rank and the operation in a failing collective's error.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        layout: ParallelLayout,
        group: dist.ProcessGroup,
        device: torch.device,
        what: str,
        warn: Callable[[str], None],
        naming: Callable[[str], AbstractContextManager[None]] = lambda _: nullcontext(),
    ) -> None:
        for name, value in zip(_OWN, (loader, layout, group, device, what, warn, naming, None), strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_length", self._agree_on_length())

    # ------------------------------------------------------------------ the loader's face
    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("_loader")
        if loader is None:  # during copy or unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. ``worker_init_fn`` on the dataloader it was handed.
        setattr(self._loader, name, value)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"{type(self._loader).__name__} has no length on every rank")
        return int(self._length)

    def __iter__(self) -> Iterator[Any]:
        return _EvenIterator(self, iter(self._loader))

    def __repr__(self) -> str:
        return f"EvenBatches({self._loader!r})"

    # ------------------------------------------------------------------ agreements
    def _agree_on_length(self) -> int | None:
        """The shortest length of any rank's loader, or ``None`` when one of them has none."""
        try:
            local = len(self._loader)
        except (TypeError, NotImplementedError):
            local = -1
        lengths = self._gather(local)
        if min(lengths) < 0:
            return None  # Lightning then learns the end from the iterator, which agrees per batch
        self._check_replicas(lengths, lambda n: f"{n} {self._what}", "have different lengths")
        if min(lengths) != max(lengths):
            self._warn(self._skipping(lengths, lambda n: n == min(lengths), at=min(lengths)))
        return min(lengths)

    def _gather(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self._device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        with self._naming(f"agreeing with every rank on the number of {self._what}"):
            dist.all_gather(every, mine, group=self._group)
        return [int(t) for t in every]

    def _replicas(self) -> list[list[int]]:
        """The global ranks of each data-parallel replica, by replica index."""
        return [self._layout.replica_ranks(d) for d in range(self._layout.data_parallel_size)]

    def _check_replicas(self, values: list[int], show: Callable[[int], str], differ: str) -> None:
        """Raise on every rank if the ranks of one replica hold different ``values``."""
        for dp_rank, ranks in enumerate(self._replicas()):
            seen: dict[int, list[int]] = {}
            for r in ranks:
                seen.setdefault(values[r], []).append(r)
            if len(seen) > 1:
                lines = [
                    f"  ranks {rs} ({', '.join(str(self._layout.coordinates(r)) for r in rs)}): {show(v)}"
                    for v, rs in seen.items()
                ]
                raise StepCheckError(
                    f"pipe_tp: the ranks of one model replica must load the same {self._what}, but the "
                    f"{self._what} of replica dp_rank {dp_rank} {differ}:\n"
                    + "\n".join(lines)
                    + "\n"
                    + SAME_DATA_FIX
                )

    def _skipping(self, values: list[int], ran_out: Callable[[int], bool], at: int) -> str:
        replicas = self._replicas()
        short = [d for d, ranks in enumerate(replicas) if ran_out(values[ranks[0]])]
        longer = [d for d in range(len(replicas)) if d not in short]
        return (
            f"pipe_tp: data-parallel replicas {short} have no more {self._what} after {at} while "
            f"replicas {longer} have more: every rank stops this loop after {at} {self._what} and "
            f"the remaining {self._what} of replicas {longer} are skipped. To use them all, give every "
            "replica the same number of batches (Lightning's DistributedSampler does; a stream "
            "sharded by hand must split evenly over trainer.strategy.data_parallel_world_size)."
        )


class _EvenIterator:
    """One pass over the loader; ``next()`` agrees with every rank before it yields or stops."""

    def __init__(self, owner: EvenBatches, inner: Iterator[Any]) -> None:
        self._owner = owner
        self._inner = inner
        self._fetched = 0
        self._done = False

    def __iter__(self) -> _EvenIterator:
        return self

    def __next__(self) -> Any:
        if self._done:  # every rank already agreed that the pass is over
            raise StopIteration
        owner = self._owner
        try:
            item, have = next(self._inner), 1
        except StopIteration:
            item, have = None, 0
        # [have, -have] under MAX gives whether anyone has one and whether everyone has one.
        flags = torch.tensor([have, -have], dtype=torch.int64, device=owner._device)
        with owner._naming(f"agreeing with every rank that each has another of its {owner._what}"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=owner._group)
        anyone, everyone = int(flags[0]) == 1, int(flags[1]) == -1
        if everyone:
            self._fetched += 1
            return item
        self._done = True
        if anyone:  # rare: find out who ran out, then stop (or raise) on every rank
            haves = owner._gather(have)
            at = self._fetched
            ended = f"end at different points (after {at} of them)"
            owner._check_replicas(haves, lambda h: "has another" if h else "has no more", ended)
            owner._warn(owner._skipping(haves, lambda h: h == 0, at=at))
        raise StopIteration
