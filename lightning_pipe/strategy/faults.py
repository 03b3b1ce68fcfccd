"""How ``PipeTPStrategy`` fails: every rank stops within seconds, naming who failed first.

A rank that fails records why on a board every rank can read (:mod:`lightning_pipe.failures`);
a rank that then loses a peer, or passes a deadline, in a collective adds to its error which
rank and operation it was and, from the board, the first failure. SIGTERM/SIGINT end a rank at
once, even inside a collective (:mod:`lightning_pipe.signals`). Issue 15.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_pipe.failures import FailureBoard
from lightning_pipe.mesh import ParallelLayout, ParallelMesh, init_mesh
from lightning_pipe.pipeline.p2p import lost_connection
from lightning_pipe.signals import StopOnSignal, passed_on_by_rank_zero
from lightning_pipe.strategy.base import PipeTPParts

_SETUP_CALLS = 0
"""Trainer calls set up in this process; the same count on every rank of the job."""


class FaultHandling(PipeTPParts):
    """The failure half of ``PipeTPStrategy``: the mesh's creation, signals, named errors."""

    pipeline_parallel_size: int | Literal["auto"]
    tensor_parallel_size: int
    data_parallel_size: int | Literal["auto"]
    _mesh: ParallelMesh | None
    _signals: StopOnSignal | None
    _failures: FailureBoard | None

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        layout = ParallelLayout.resolve(
            self.world_size, self.pipeline_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        )
        global _SETUP_CALLS
        _SETUP_CALLS += 1  # every rank counts the same Trainer calls: a prefix all ranks agree on
        self._failures = FailureBoard.of_default_group(f"lightning_pipe/failures/{_SETUP_CALLS}")
        self._mesh = None
        with self._collective(f"creating the process groups of the {layout} mesh"):
            self._mesh = init_mesh(layout, "cuda" if self.root_device.type == "cuda" else "cpu")
        if self.world_size > 1 and self._signals is None:
            self._signals = StopOnSignal(
                f"rank {self.global_rank} ({self._mesh.coordinates})",
                before_exit=self._kill_launched_processes,
            )
        if self._signals is not None:
            self._signals.install()

    def _kill_launched_processes(self, signum: int) -> None:
        """Record the signal for the other ranks' errors; the processes Lightning's launcher started
        from this one (ranks 1.. under ``popen``) go at once: each would otherwise print its own
        line and wait to lose a peer."""
        if self._failures is not None:
            self._failures.report(f"received {signal.Signals(signum).name}")
        if self.launcher is not None:
            self.launcher.kill(signal.SIGKILL)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Record this rank's failure, so that the ranks that lose it can name it."""
        if isinstance(exception, SIGTERMException):
            where = f" ({self._mesh.coordinates})" if self._mesh is not None else ""
            passed_on_by_rank_zero(exception, self.global_rank, f"rank {self.global_rank}{where}")
        if self._failures is not None:
            summary = str(exception).strip().splitlines()[0][:300] if str(exception).strip() else ""
            self._failures.report(f"raised {type(exception).__name__}: {summary}")
        super().on_exception(exception)

    def _first_failure_note(self, err: BaseException) -> None:
        """Add to ``err`` which rank failed first, when another rank's failure is recorded."""
        first = self._failures.first() if self._failures is not None else None
        if (
            first is not None
            and not first.startswith(f"rank {self.global_rank} ")
            and hasattr(err, "add_note")
        ):
            err.add_note(f"The first rank to fail: {first}.")

    @contextmanager
    def _collective(self, what: str, peers: Sequence[int] = ()) -> Iterator[None]:
        """Name this rank and the operation in any error a collective raises (a peer that failed
        first, or a deadline that passed); ``peers``, the other ranks of the collective's group,
        are named when the error is a lost connection."""
        try:
            yield
        except Exception as err:
            if peers and lost_connection(str(err)) and hasattr(err, "add_note"):
                who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {list(peers)}"
                err.add_note(f"{who} has stopped (its own error, in its log, is the cause).")
            where = f" ({self._mesh.coordinates})" if self._mesh is not None else ""
            note = (
                f"Rank {self.global_rank}{where} failed while {what}; if another rank failed first, its "
                "error is the cause."
            )
            if hasattr(err, "add_note"):
                err.add_note(note)
            self._first_failure_note(err)
            raise

    @override
    def barrier(self, name: str | None = None) -> None:
        with self._collective(f"waiting for every rank at Lightning's barrier {name!r}"):
            super().barrier(name)

    @contextmanager
    def _naming_first_failure(self, kind: type[BaseException]) -> Iterator[None]:
        try:
            yield
        except kind as err:
            self._first_failure_note(err)
            raise

    @override
    def teardown(self) -> None:
        if self._signals is not None:
            self._signals.uninstall()
        super().teardown()
