"""How ``PipeTPStrategy`` fails: every rank stops within seconds, naming who failed first.

A rank that fails records why on a board every rank can read (:mod:`lightning_pipe.failures`);
a rank that then loses a peer, or passes a deadline, in a collective adds to its error which
rank and operation it was and, from the board, the first failure. SIGTERM/SIGINT end a rank at
once, even inside a collective (:mod:`lightning_pipe.signals`). Issue 15.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Literal

from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_pipe.failures import FailureBoard, PeerLostError, lost_connection
from lightning_pipe.mesh import ParallelLayout, ParallelMesh, init_mesh
from lightning_pipe.pipeline.p2p import PipelineCommunicationError
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
        self._failures = FailureBoard.of_default_group(
            f"lightning_pipe/failures/{_SETUP_CALLS}", lambda rank: str(layout.coordinates(rank))
        )
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
        """Record this rank's failure, so that the ranks that lose it can name it; a rank that
        only lost a peer says, in one line before its traceback, which rank stopped and why."""
        if isinstance(exception, SIGTERMException):
            where = f" ({self._mesh.coordinates})" if self._mesh is not None else ""
            passed_on_by_rank_zero(exception, self.global_rank, f"rank {self.global_rank}{where}")
        board = self._failures
        text = str(exception).strip()
        if board is not None:
            if isinstance(exception, PeerLostError | PipelineCommunicationError):
                _first_line(f"lightning_pipe: {text.splitlines()[0]}")
            elif lost_connection(text):
                # A collective outside the named ones (Lightning's own, a callback's): explain it here.
                lost = board.lost_error(exception, "in a collective")
                if hasattr(exception, "add_note"):
                    exception.add_note(str(lost))
                _first_line(f"lightning_pipe: {lost}")
            else:
                summary = text.splitlines()[0][:300] if text else ""
                board.report(f"raised {type(exception).__name__}: {summary}")
            board.linger()  # the store's host: the others may still be reading the board
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

    def _lost_peers(self, what: str, peers: Sequence[int] = ()) -> AbstractContextManager[None]:
        """A lost connection inside the block becomes a :class:`PeerLostError` naming the rank
        that stopped and why (other errors pass unchanged)."""
        return self._failures.naming(what, peers) if self._failures is not None else nullcontext()

    @contextmanager
    def _collective(self, what: str, peers: Sequence[int] = ()) -> Iterator[None]:
        """Name this rank and the operation in any error a collective raises: a lost connection
        becomes a :class:`PeerLostError` naming the rank that stopped (among ``peers``, the other
        ranks of the collective's group; all ranks when empty) and why; any other error (a
        deadline that passed) gets notes naming this rank, the operation and the first failure."""
        try:
            with self._lost_peers(what, peers):
                yield
        except PeerLostError:
            raise
        except Exception as err:
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
        """Add the first failure to a ``kind`` error that does not already explain a lost peer
        (a deadline that passed: the peer may be stuck behind another rank's failure)."""
        try:
            yield
        except kind as err:
            if not lost_connection(str(err)):
                self._first_failure_note(err)
            raise

    @override
    def teardown(self) -> None:
        if self._signals is not None:
            self._signals.uninstall()
        super().teardown()


def _first_line(text: str) -> None:
    """Write ``text`` to standard error at once: it precedes the traceback Lightning prints."""
    try:
        sys.stderr.write(text.splitlines()[0] + "\n")
        sys.stderr.flush()
    except Exception:
        pass
