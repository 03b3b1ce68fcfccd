"""Name this rank and what it was doing in the error any collective raises.

A collective that fails says little: a lost connection names an address, a deadline names
nothing. Every collective of the engine (and of the Lightning adapter) runs inside a
:class:`CollectiveNaming` block that says what it is for, so that:

* a lost connection becomes a :class:`~lightning_pipe.faults.board.PeerLostError` naming the rank
  that stopped and how (:meth:`FaultBoard.naming <lightning_pipe.faults.board.FaultBoard.naming>`);
* any other error (a deadline that passed) gets notes naming this rank, its coordinates, the
  operation and, from the board, the first rank to fail.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

from lightning_pipe.faults.board import FaultBoard, PeerLostError, add_note


class CollectiveNaming:
    """``naming(what, peers)``: a context that names this rank and ``what`` in a collective's error.

    Args:
        rank: this process's global rank.
        where: its coordinates, for messages (``"dp_rank 0, pp_rank 1, tp_rank 0"``).
        board: the job's fault board (``None``: lost connections are left as the transport says).
    """

    def __init__(self, rank: int, where: str = "", board: FaultBoard | None = None) -> None:
        self.rank, self.where, self.board = rank, where, board

    @contextmanager
    def __call__(self, what: str, peers: Sequence[int] = ()) -> Iterator[None]:
        try:
            with self.board.naming(what, peers) if self.board is not None else nullcontext():
                yield
        except PeerLostError:
            raise
        except Exception as err:
            where = f" ({self.where})" if self.where else ""
            add_note(
                err,
                f"Rank {self.rank}{where} failed while {what}; if another rank failed first, its error is "
                "the cause.",
            )
            self.note_first_failure(err)
            raise

    def lost_peers(self, what: str, peers: Sequence[int] = ()) -> AbstractContextManager[None]:
        """Only the lost-connection part: other errors pass unchanged (for blocks whose own
        errors already say everything, such as a checkpoint's collective outcome)."""
        return self.board.naming(what, peers) if self.board is not None else nullcontext()

    def note_first_failure(self, err: BaseException) -> None:
        """Add to ``err`` which rank failed first, when another rank's failure is recorded."""
        first = self.board.first() if self.board is not None else None
        if first is not None and not first.startswith(f"rank {self.rank} "):
            add_note(err, f"The first rank to fail: {first}.")
