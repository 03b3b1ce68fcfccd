"""Which rank failed first: a board in the rendezvous store that every failing rank writes to.

When one rank stops (an exception in a callback, a signal), its peers see only a lost connection
("Connection closed by peer") in whatever collective they were in, which names an address, not a
rank, and not the cause. Each rank that fails therefore takes a ticket from a counter in the
job's rendezvous store (``TCPStore``, which every rank already talks to) and writes what happened
under it; a rank whose collective failed reads ticket 1 and names the first failure in its own
error. Tickets live under a prefix per Trainer call, so a failure that an earlier call caught and
handled is never blamed for a later one. If the store itself is gone, it lived in the process of
the rank that hosts it (global rank 0 with ``env://``), which has then stopped.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_FIRST_WAIT_S = 1.0  # a peer's report may trail its lost connection by a moment


class FailureBoard:
    """Report this rank's failure, or name the first failure of the job's current call."""

    def __init__(self, store: dist.Store | None, prefix: str, rank: int) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank

    @classmethod
    def of_default_group(cls, prefix: str) -> FailureBoard:
        store = None
        try:
            # Private in torch, public in effect: the store the default group rendezvoused with.
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store (a custom init): reports and look-ups do nothing
            store = None
        return cls(store, prefix, dist.get_rank())

    def report(self, what: str) -> None:
        """Record that this rank failed (never raises: it runs on the way out)."""
        if self.store is None:
            return
        try:
            ticket = self.store.add(f"{self.prefix}/count", 1)
            self.store.set(f"{self.prefix}/{ticket}", f"rank {self.rank} {what}")
        except Exception:
            pass

    def first(self) -> str | None:
        """The first recorded failure, e.g. ``"rank 1 raised ValueError: ..."``, if any."""
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
            return "the rendezvous store is unreachable: the rank that hosts it (global rank 0) has stopped"
