"""How ``PipeTPStrategy`` fails: every rank stops within seconds, naming who failed first and how.

A rank that fails records why on the job's fault board (:mod:`lightning_pipe.faults.board`); a
rank that loses a peer in a collective or an exchange names it (vanished, raised, exited) in its
own error and in a first line before its traceback; SIGTERM/SIGINT end a rank at once, even
inside a collective (:mod:`lightning_pipe.faults.signals`). :class:`FaultHandling` holds these for
one strategy; the strategy's hooks call it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_pipe.faults.board import FaultBoard, PeerLostError, add_note, lost_connection
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.faults.signals import StopOnSignal, passed_on_by_rank_zero
from lightning_pipe.mesh import NodePlacement, ParallelLayout
from lightning_pipe.runtime import PipelineCommunicationError

_SETUP_CALLS = 0
"""Trainer calls set up in this process; the same count on every rank of the job."""


class FaultHandling:
    """The fault board, the signal watcher and the naming of collectives of one strategy."""

    def __init__(self) -> None:
        self.board: FaultBoard | None = None
        self.signals: StopOnSignal | None = None
        self.naming = CollectiveNaming(0)
        """Names this rank (and what it was doing) in a failing collective's error."""
        self._where = ""
        self._rank_zero = "global rank 0"

    def start(self, layout: ParallelLayout, rank: int, before_exit: Callable[[int], None] | None) -> None:
        """At each Trainer call's setup (the process group exists): a board for this call's
        reports, the naming of this rank's collectives and, with several ranks, the signal watcher
        (``before_exit`` runs when a signal ends the process)."""
        global _SETUP_CALLS
        _SETUP_CALLS += 1  # every rank counts the same Trainer calls: a prefix all ranks agree on
        # The layout's own method (not a closure of this module): the engine keeps this board, and
        # holds no callable of the adapter's.
        self.board = FaultBoard.of_default_group(
            f"lightning_pipe/failures/{_SETUP_CALLS}", layout.coordinates
        )
        self._where = str(layout.coordinates(rank))
        self._rank_zero = f"rank 0 ({layout.coordinates(0)})"
        self.naming = CollectiveNaming(rank, self._where, self.board)
        if layout.world_size > 1 and self.signals is None:
            self.signals = StopOnSignal(
                f"rank {rank} ({self._where})", before_exit=before_exit, explain=self._signal_cause
            )
        if self.signals is not None:
            self.signals.install()

    def know_nodes(self, nodes: NodePlacement) -> None:
        """Where every rank runs, so that a survivor that loses every rank of a node says so."""
        if self.board is not None and nodes.num_nodes > 1:
            self.board.nodes = [nodes.label(r) for r in range(len(nodes.node_ranks))]

    def _signal_cause(self, signum: int) -> str | None:
        """Under torchrun, a SIGTERM that its agent sent because it lost the rendezvous store (a
        node went down) before this rank noticed it: the words naming that node."""
        if signum != signal.SIGTERM or "TORCHELASTIC_RUN_ID" not in os.environ or self.board is None:
            return None
        lost = self.board.store_lost()
        return None if lost is None else f"sent by torchrun's agent: {lost}"

    def report_signal(self, signum: int) -> None:
        if self.board is not None:
            self.board.report(f"received {signal.Signals(signum).name}")

    def on_exception(self, exception: BaseException, rank: int) -> None:
        """Record this rank's failure, so that the ranks that lose it can name it; a rank that
        only lost a peer says, in one line before its traceback, which rank stopped and how."""
        if isinstance(exception, SIGTERMException):
            where = f" ({self._where})" if self._where else ""
            passed_on_by_rank_zero(exception, rank, f"rank {rank}{where}", self._rank_zero)
        board = self.board
        if board is None:
            return
        text = str(exception).strip()
        if isinstance(exception, PeerLostError | PipelineCommunicationError):
            _first_line(f"lightning_pipe: {text.splitlines()[0]}")
        elif lost_connection(text):
            # A collective outside the named ones (Lightning's own, a callback's): explain it here.
            lost = board.lost_error(exception, "in a collective")
            add_note(exception, str(lost))
            _first_line(f"lightning_pipe: {lost}")
        else:
            summary = text.splitlines()[0][:300] if text else ""
            board.report(f"raised {type(exception).__name__}: {summary}")
        board.linger()  # the store's host: the others may still be reading the board

    def teardown(self) -> None:
        if self.signals is not None:
            self.signals.uninstall()


def _first_line(text: str) -> None:
    """Write ``text`` to standard error at once: it precedes the traceback Lightning prints."""
    try:
        sys.stderr.write(text.splitlines()[0] + "\n")
        sys.stderr.flush()
    except Exception:
        pass
