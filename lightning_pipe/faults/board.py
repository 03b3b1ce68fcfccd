"""Who stopped first, and how: a board in the rendezvous store, and a heartbeat per process.

When one rank stops, its peers see only a lost connection ("Connection reset by peer") in
whatever collective or exchange they were in: an address, not a rank, and not the cause. Two
records in the job's rendezvous store (the ``TCPStore`` every rank already talks to) let every
survivor name the rank that stopped and say why:

* **Reports.** A rank that fails writes what happened. A rank whose own error is the cause (an
  exception in the user's code, a signal) takes a ticket from a counter, so the first cause is
  ticket 1; a rank that only lost a peer writes a *victim* report (whom it lost), which is never
  blamed as the first failure. Reports live under a prefix per Trainer call, so a failure that an
  earlier call caught and handled is never blamed for a later one.
* **Heartbeats.** Every process increments its counter twice a second from a daemon thread (over
  its own store connection, so that a long store operation of the main thread never stalls it),
  and marks a clean interpreter exit. A peer whose counter stands still and that reported nothing
  vanished without an error of its own: killed (SIGKILL, the out-of-memory killer). Such a rank
  leaves no log, so the survivors' words are all the user gets.

The store lives in one process: global rank 0 under Lightning's launcher and ``env://`` (torchrun
hosts it in its agent instead). A rank blocked in an exchange or a collective with that host learns
of a failure only when the host's process ends, and the store with it; so each heartbeat thread
also reads the board (the first cause, the victims' reports) into a copy in its process, and marks
that it did. The host, when it fails, waits until every other rank has reported, exited, gone
silent or read the board (:meth:`FaultBoard.linger`, a few seconds at most) before its process
goes; a rank that then finds the store gone names the failure from its copy.

Plain torch: the engine's transport and the Lightning adapter both explain lost peers with it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import torch.distributed as dist

HEARTBEAT_S = 0.5
"""How often each process's heartbeat counter moves."""
_SILENT_S = 2.0
"""A counter that stands still this long (four beats) belongs to a process that is gone."""
_FIRST_WAIT_S = 1.0
"""A peer's report may trail its lost connection by a moment."""
_LINGER_S = 5.0
"""The most the store's host waits for the other ranks to read the board: enough for a survivor to
explain its loss; a rank that is still blocked in a collective with the host learns of the failure
only when the host's process ends, and then finds the store gone (the message says so)."""
_PROCESS = "lightning_pipe/process"


def lost_connection(message: str) -> bool:
    """Whether a transport error says the peer's process has gone (its sockets closed)."""
    return any(
        sign in message
        for sign in ("closed by peer", "Connection reset", "Broken pipe", "Connection refused")
    )


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` where Python has notes (3.11+); on 3.10 the note is dropped."""
    if hasattr(err, "add_note"):
        err.add_note(note)


def underlying(err: BaseException) -> str:
    """The transport error's first sentence (gloo appends generic advice after it)."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text.split(". This is typically")[0]


class PeerLostError(RuntimeError):
    """This rank lost a peer in a collective or exchange; the message names the peer and why."""


def _agent_hosts_store() -> bool:
    """torchrun keeps the rendezvous store in its agent process, not in rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


class _Heartbeat:
    """The process's heartbeat: one daemon thread, started once per process; it also keeps a copy
    of the current board's failure records (:meth:`copied`), for when the store has gone."""

    _started: ClassVar[dict[int, _Heartbeat]] = {}  # rank -> the running heartbeat (one per process)

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.rank = rank
        self.prefix: str | None = None  # the board whose records are copied (the latest Trainer call's)
        self._first: str | None = None
        self._victims: list[str] = []
        self._lock = threading.Lock()
        try:  # its own connection: the main thread's long store waits must not stall the beat
            self.store = store.clone()  # type: ignore[attr-defined]  # (torch >= 2.5; PrefixStore)
        except Exception:
            self.store = store
        self._stop = threading.Event()
        self.store.add(f"{_PROCESS}/beat/{rank}", 1)
        threading.Thread(target=self._run, name="lightning_pipe-heartbeat", daemon=True).start()
        atexit.register(self._exited)

    @classmethod
    def ensure(cls, store: dist.Store, rank: int) -> None:
        if rank not in cls._started:
            cls._started[rank] = cls(store, rank)

    def watch(self, prefix: str) -> None:
        """Copy the records of the board ``prefix`` from now on (those of an earlier one are
        dropped: a failure an earlier Trainer call handled is no cause of a later one)."""
        with self._lock:
            if prefix != self.prefix:
                self.prefix, self._first, self._victims = prefix, None, []

    def copied(self) -> tuple[str | None, list[str]]:
        """The board's first cause and victims' reports, as last read."""
        with self._lock:
            return self._first, list(self._victims)

    def _text(self, key: str) -> str | None:
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def _run(self) -> None:
        key = f"{_PROCESS}/beat/{self.rank}"
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.add(key, 1)
                self._read_board()
            except Exception:  # the store's host is gone: nobody can read the beat any more
                return

    def _read_board(self) -> None:
        """Copy the board's new records, then mark that this rank holds them (two counter reads
        a beat when nothing failed)."""
        prefix = self.prefix
        if prefix is None:
            return
        first, victims = self.copied()
        new_first = first
        # A record's counter moves before its text is written: read only texts already there (a
        # get of a missing key would block the beat).
        if first is None and int(self.store.add(f"{prefix}/count", 0)) > 0:
            new_first = self._text(f"{prefix}/1")
        new_victims: list[str] = []
        for n in range(len(victims) + 1, int(self.store.add(f"{prefix}/lost", 0)) + 1):
            text = self._text(f"{prefix}/lost/{n}")
            if text is None:
                break
            new_victims.append(text)
        if new_first == first and not new_victims:
            return
        with self._lock:
            if prefix == self.prefix:
                self._first = new_first
                self._victims += new_victims
        self.store.set(f"{prefix}/seen/{self.rank}", "1")

    def _exited(self) -> None:
        """A clean interpreter exit (the script ended), so a silent beat is not a vanished rank."""
        self._stop.set()
        try:
            self.store.set(f"{_PROCESS}/exited/{self.rank}", "1")
        except Exception:
            pass


class FaultBoard:
    """Report this rank's failure; name the rank a survivor lost, and the first failure.

    Args:
        store: the job's rendezvous store (``None``: every method does nothing useful, gracefully).
        prefix: the reports' namespace (one per Trainer call).
        rank: this process's global rank.
        describe: global rank -> where it sits, as text or an object whose ``str`` is that text
            (``"dp_rank 0, pp_rank 1, tp_rank 0"``); e.g. a ``ParallelLayout.coordinates``.
    """

    def __init__(
        self,
        store: dist.Store | None,
        prefix: str,
        rank: int,
        world_size: int,
        describe: Callable[[int], object] = lambda rank: "",
    ) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.describe = describe
        self.nodes: Sequence[str] | None = None
        """Each global rank's node, in words (``"node 1 (host-b)"``), when known: a survivor that
        finds every rank of a node vanished says the node is lost."""
        self.hosts_store = rank == 0 and not _agent_hosts_store()
        self._lingered = False
        if store is not None:
            try:
                _Heartbeat.ensure(store, rank)
                _Heartbeat._started[rank].watch(prefix)
            except Exception:  # a store without counters: reports still work
                pass

    @classmethod
    def of_default_group(cls, prefix: str, describe: Callable[[int], object] = lambda rank: "") -> FaultBoard:
        store = None
        try:
            # Private in torch, public in effect: the store the default group rendezvoused with.
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store (a custom init): reports and look-ups do nothing
            store = None
        return cls(store, prefix, dist.get_rank(), dist.get_world_size(), describe)

    def who(self, rank: int) -> str:
        where = str(self.describe(rank))
        return f"rank {rank} ({where})" if where else f"rank {rank}"

    # ------------------------------------------------------------------ reports
    def report(self, what: str) -> None:
        """Record that this rank failed by its own error (never raises: it runs on the way out)."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/report/{self.rank}", f"{self.who(self.rank)} {what}")
            ticket = self.store.add(f"{self.prefix}/count", 1)
            self.store.set(f"{self.prefix}/{ticket}", f"{self.who(self.rank)} {what}")
        except Exception:
            pass

    def report_victim(self, what: str) -> None:
        """Record that this rank stopped because it lost a peer (``what``: whom, and why); on the
        store's host, then wait for the other survivors to read the board (:meth:`linger`)."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/victim/{self.rank}", what)
            # Numbered too, for the heartbeats' copies (one counter read finds a new one).
            number = self.store.add(f"{self.prefix}/lost", 1)
            self.store.set(f"{self.prefix}/lost/{number}", f"{self.who(self.rank)} stopped after it {what}")
        except Exception:
            return
        self.linger()

    def first(self) -> str | None:
        """The first failure that was a cause (``"rank 1 (...) raised ValueError: ..."``), if any."""
        if self.store is None:
            return None
        key = f"{self.prefix}/1"
        deadline = time.monotonic() + _FIRST_WAIT_S
        try:
            while not self.store.check([key]):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
            return self.store.get(key).decode(errors="replace")
        except Exception:
            return self._store_gone()

    def store_lost(self) -> str | None:
        """Why the store no longer answers (:meth:`_store_gone`'s words), or ``None`` while it does.
        Under torchrun a rank may hear of the store's loss first from its agent, which sends it
        SIGTERM before the rank's own exchanges notice (the signal watcher asks this)."""
        if self.store is None:
            return None
        try:
            self.store.check([f"{self.prefix}/1"])
        except Exception:
            return self._store_gone()
        return None

    def _store_gone(self) -> str:
        """The store is unreachable: what this process's heartbeat read from the board before it
        went, or, when it read nothing, that the store's host has stopped."""
        heartbeat = _Heartbeat._started.get(self.rank)
        first, victims = heartbeat.copied() if heartbeat is not None else (None, [])
        read = victims[:2] + ([f"the first rank to fail: {first}"] if first is not None else [])
        host = f"torchrun's agent{self._node_of_rank_zero()}" if _agent_hosts_store() else self.who(0)
        if read:
            return "; ".join(read) + f" (read from the failure board before its host, {host}, stopped)"
        if _agent_hosts_store() and self.nodes:
            return (
                f"the rendezvous store in {host} is unreachable: that node's launcher has stopped (the "
                "node went down, or its agent was killed or ended)"
            )
        if _agent_hosts_store():
            return "the rendezvous store in torchrun's agent is unreachable: the launcher has stopped"
        return (
            f"the rendezvous store is unreachable, so {host}, the process that hosts it, has stopped; "
            "its log names the cause (its own error, or the rank it lost), unless it was killed"
        )

    def _node_of_rank_zero(self) -> str:
        """``" on node 0 (host-a), with ranks 0, 1"`` when the nodes are known: torchrun's agent of
        the node that runs global rank 0 hosts the store its ranks share."""
        if not self.nodes:
            return ""
        node = self.nodes[0]
        ranks = ", ".join(str(r) for r in range(self.world_size) if self.nodes[r] == node)
        return f" on {node}, with ranks {ranks}"

    def _get(self, key: str) -> str | None:
        assert self.store is not None
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def _beats(self, ranks: Sequence[int]) -> list[int]:
        assert self.store is not None
        return [int(self.store.add(f"{_PROCESS}/beat/{r}", 0)) for r in ranks]

    # ------------------------------------------------------------------ explaining a loss
    def explain_lost(self, peers: Sequence[int] = ()) -> str:
        """Why this rank lost ``peers`` (the other end of an exchange, or the other ranks of a
        collective; empty: every other rank): the peer that raised, vanished or exited, in words.

        Takes up to about two seconds: a peer is found vanished when its heartbeat is seen
        standing still that long; a peer that reports its own error ends the wait earlier."""
        candidates = [r for r in (peers or range(self.world_size)) if r != self.rank]
        # The other ranks of the candidates' nodes, watched alongside (never waited for): when all
        # of a node's ranks vanish together, the node (or its launcher) is what was lost.
        nodes = self.nodes if self.nodes is not None and len(self.nodes) == self.world_size else None
        mates: list[int] = []
        if nodes is not None:
            their_nodes = {nodes[r] for r in candidates}
            mates = [
                r for r in range(self.world_size)
                if nodes[r] in their_nodes and r not in candidates and r != self.rank
            ]  # fmt: skip
        if self.store is None:
            who = self.who(candidates[0]) if len(candidates) == 1 else f"one of ranks {candidates}"
            return f"{who} has stopped"
        try:
            causes: dict[int, str | None] = dict.fromkeys(candidates)
            victims: dict[int, str | None] = dict.fromkeys(candidates)
            watched = candidates + mates
            start = self._beats(watched)
            moved: set[int] = set()
            deadline = time.monotonic() + _SILENT_S
            while True:
                for r in candidates:
                    causes[r] = causes[r] or self._get(f"{self.prefix}/report/{r}")
                    victims[r] = victims[r] or self._get(f"{self.prefix}/victim/{r}")
                moved |= {r for r, a, b in zip(watched, start, self._beats(watched), strict=True) if a != b}
                undecided = [r for r in candidates if not (causes[r] or victims[r] or r in moved)]
                if not undecided or time.monotonic() > deadline:
                    break
                time.sleep(HEARTBEAT_S / 2)
            silent = [r for r in candidates if not (causes[r] or victims[r]) and r not in moved]
            exited = [r for r in silent if self._get(f"{_PROCESS}/exited/{r}") is not None]
            vanished = [r for r in silent if r not in exited]
            lost_nodes = self._lost_nodes(vanished, mates, moved) if nodes is not None else []
            first = self._get(f"{self.prefix}/1")
        except Exception:
            return self._store_gone()
        parts: list[str] = []
        if vanished:
            names = ", ".join(self.who(r) for r in vanished)
            parts.append(
                f"{names} vanished without an error of its own: its process ended without reporting one "
                "(killed by a signal such as SIGKILL, or by the out-of-memory killer; such a process "
                "leaves no log)"
            )
        parts += lost_nodes
        for r in exited:
            parts.append(
                f"{self.who(r)} finished its script and exited while this rank still needed it (the ranks "
                "ran different numbers of steps, or different Trainer calls)"
            )
        parts += [f"{causes[r]} (see its log)" for r in candidates if causes[r]]
        if not parts:
            lost = [r for r in candidates if victims[r]]
            if lost:  # only victims among the peers: the cause is further away, in their report
                parts.append(f"{self.who(lost[0])} stopped after it {victims[lost[0]]}")
        if first is not None and first not in "; ".join(parts):
            parts.append(f"the first rank to fail: {first}")
        if not parts:
            who = self.who(candidates[0]) if len(candidates) == 1 else f"one of ranks {candidates}"
            parts.append(f"{who} closed its connection (its own error should follow in its log)")
        return "; ".join(parts)

    def _lost_nodes(self, vanished: Sequence[int], mates: Sequence[int], moved: set[int]) -> list[str]:
        """For each node of a ``vanished`` rank whose every rank (but this one) vanished too
        (``mates``: the watched others, silent unless in ``moved``, and with no report of their
        own), a sentence naming the node and its ranks: a node that went down, not one process."""
        assert self.nodes is not None
        parts = []
        for node in dict.fromkeys(self.nodes[r] for r in vanished):
            on_node = [r for r in range(self.world_size) if self.nodes[r] == node and r != self.rank]
            others = [r for r in on_node if r not in vanished]
            if len(on_node) < 2 or any(r not in mates or r in moved for r in others):
                continue
            reported = (f"{self.prefix}/report/{r}" for r in others)
            if any(self._get(key) for key in reported) or any(
                self._get(f"{_PROCESS}/exited/{r}") for r in others
            ):
                continue
            ranks = ", ".join(str(r) for r in on_node)
            parts.append(
                f"{node} is lost: all of its ranks ({ranks}) stopped at once without an error of their "
                "own (the node went down, or its launcher was killed)"
            )
        return parts

    @contextmanager
    def naming(self, doing: str, peers: Sequence[int] = ()) -> Iterator[None]:
        """Turn a lost connection inside the block into a :class:`PeerLostError` that names the
        peer that stopped and why; ``doing`` says what this rank was doing."""
        try:
            yield
        except PeerLostError:
            raise
        except Exception as err:
            if not lost_connection(str(err)):
                raise
            raise self.lost_error(err, doing, peers) from None

    def lost_error(self, err: BaseException, doing: str, peers: Sequence[int] = ()) -> PeerLostError:
        """The error for this rank having lost ``peers`` while ``doing`` (``err``: the transport's)."""
        why = self.explain_lost(peers)
        self.report_victim(f"lost its peer while {doing}: {why}")
        return PeerLostError(
            f"{self.who(self.rank)} stopped while {doing}: {why}. (Underlying error: {underlying(err)})"
        )

    def linger(self) -> None:
        """On the store's host, failing: wait (a few seconds at most, once) until every other rank
        has reported, exited, gone silent or copied the board, so that their explanations can
        still read it (a rank blocked with this one learns of the failure only when its process
        ends, and then names it from its copy)."""
        if self.store is None or not self.hosts_store or self._lingered:
            return
        self._lingered = True  # once: a second wait would only wait for the same ranks again
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + _LINGER_S
        try:
            last = self._beats(others)
            moved_at = {r: time.monotonic() for r in others}
            while time.monotonic() < deadline:
                pending = [
                    r
                    for r in others
                    if self._get(f"{self.prefix}/report/{r}") is None
                    and self._get(f"{self.prefix}/victim/{r}") is None
                    and self._get(f"{_PROCESS}/exited/{r}") is None
                    and self._get(f"{self.prefix}/seen/{r}") is None  # it holds a copy of the board
                    and time.monotonic() - moved_at[r] < _SILENT_S
                ]
                if not pending:
                    return
                time.sleep(HEARTBEAT_S / 2)
                now = self._beats(others)
                for r, b, n in zip(others, last, now, strict=True):
                    if n != b:
                        moved_at[r] = time.monotonic()
                last = now
        except Exception:
            return
