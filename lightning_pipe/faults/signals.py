"""Stop a rank within moments of SIGTERM or SIGINT, even while it waits inside a collective.

Python runs a signal handler only when the main thread returns to the interpreter, and a rank of
a pipeline spends its waiting time inside one C++ call (a gloo or NCCL wait) that returns only at
its deadline, minutes later. Lightning's own SIGTERM handler makes it worse: it runs a world
broadcast inside the handler, which cannot match ranks that are in the middle of pipeline
exchanges. So the signal is taken where Python can still see it at once:
``signal.set_wakeup_fd`` makes the C-level handler write the signal number to a pipe, and a
watcher thread (which runs while the main thread waits with the GIL released) reads it, says in
one line which rank received which signal, runs the ``before_exit`` callback (the strategy kills
the processes its launcher started) and ends the process with ``128 + signum``. The other ranks
then lose their connection to this one and stop with an error that names it, within seconds,
whatever the exchange deadline. A checkpoint being written is left as the writer's temporary
directory; the previous checkpoint stays intact.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from lightning_pipe.faults.board import add_note

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXPLAIN_S = 2.0
"""How long a signalled process waits for :attr:`StopOnSignal.explain` before it ends anyway."""


def _ignore(signum: int, frame: Any) -> None:
    """A Python-level handler, so that the C-level one (which feeds the wakeup pipe) is installed."""


class StopOnSignal:
    """While installed, SIGTERM or SIGINT ends this process at once with ``128 + signum``.

    Args:
        describe: who this process is, for the one-line message (``"rank 1 (pp_rank 1, ...)"``).
        before_exit: called with the signal number just before the process ends.
        explain: called with the signal number for why it came, when the process can tell (under
            torchrun: its agent lost the rendezvous store, which the ranks had not noticed yet);
            given at most :data:`EXPLAIN_S` seconds, then the process ends without it.
    """

    def __init__(
        self,
        describe: str,
        before_exit: Callable[[int], None] | None = None,
        explain: Callable[[int], str | None] | None = None,
    ) -> None:
        self.describe = describe
        self.before_exit = before_exit
        self.explain = explain
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1
        self._previous_handlers: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return self._pipe is not None

    def install(self) -> bool:
        """Start watching; returns ``False`` (and does nothing) outside the main thread, where
        Python does not allow a wakeup file descriptor."""
        if self._pipe is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for signum in _SIGNALS:
            handler = signal.getsignal(signum)
            if handler in (signal.SIG_DFL, signal.SIG_IGN, None):
                self._previous_handlers[signum] = handler
                signal.signal(signum, _ignore)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._pipe = (read_fd, write_fd)
        threading.Thread(
            target=self._watch, args=(read_fd,), name="lightning_pipe-signals", daemon=True
        ).start()
        return True

    def uninstall(self) -> None:
        """Stop watching and restore the previous wakeup descriptor and default handlers."""
        if self._pipe is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
        write_fd = self._pipe[1]
        self._pipe = None
        self._previous_handlers = {}
        os.close(write_fd)  # the watcher's read returns b"" and it ends (it closes read_fd)

    def _watch(self, read_fd: int) -> None:
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:
                    return
                for signum in data:
                    if signum in _SIGNALS:
                        self._stop(signum)
        finally:
            os.close(read_fd)

    def _why(self, signum: int) -> str | None:
        """:attr:`explain`'s answer, if it comes within :data:`EXPLAIN_S` (a store on a node that
        went down may not answer at all: the process must still end)."""
        if self.explain is None:
            return None
        found: list[str | None] = []

        def ask() -> None:
            try:
                found.append(self.explain(signum))  # type: ignore[misc]
            except Exception:
                pass

        worker = threading.Thread(target=ask, name="lightning_pipe-signal-cause", daemon=True)
        worker.start()
        worker.join(EXPLAIN_S)
        return found[0] if found else None

    def _stop(self, signum: int) -> None:
        name = signal.Signals(signum).name
        why = self._why(signum)
        launcher = (
            f" ({why})"
            if why
            else " (torchrun sends SIGTERM to every rank when one of them fails: its summary names that rank)"
            if signum == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ
            else ""
        )
        message = (
            f"lightning_pipe: {self.describe} received {name}{launcher}; stopping it now (exit code "
            f"{128 + signum}); the other ranks stop when they lose it.\n"
        )
        try:
            os.write(2, message.encode())
            if self.before_exit is not None:
                self.before_exit(signum)
        finally:
            os._exit(128 + signum)


def passed_on_by_rank_zero(
    exception: SystemExit, rank: int, describe: str, rank_zero: str = "global rank 0"
) -> None:
    """Give Lightning's ``SIGTERMException`` an exit status and, on the ranks that did not receive
    the signal, one line naming the rank that did.

    Lightning (2.6) broadcasts global rank 0's "received SIGTERM" flag from every training step
    and raises ``SIGTERMException``, a ``SystemExit`` without a code, on every rank: a rank whose
    main thread reaches that broadcast before the watcher above ends rank 0 would exit with status
    0 and no word of why. Rank 0 received the signal (``128 + SIGTERM``); the others exit 1.
    ``rank_zero`` names rank 0 the way every other message does (with its coordinates), so a
    reader (or a log search) finds the same words whichever path told this rank.
    """
    if rank == 0:
        exception.code = 128 + signal.SIGTERM
        return
    exception.code = 1
    line = (
        f"lightning_pipe: {describe} stops: {rank_zero} received SIGTERM, which Lightning passes on "
        "to every rank; rank 0 has stopped."
    )
    os.write(2, (line + "\n").encode())
    add_note(exception, line)
