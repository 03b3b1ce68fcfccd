"""Name the collectives a batch's layers drive, when a peer is lost inside one of them.

The collectives of tensor parallelism (Megatron's regions, sequence parallelism, the vocab-parallel
loss) and of FSDP2 (its parameter all-gathers and gradient reduce-scatters) run inside layers'
forwards, autograd backwards and torch's own hooks, where the runtime's ``with naming(...)``
blocks cannot reach: a peer lost there surfaced as the transport's bare "Connection closed by
peer". While a batch runs:

* every tensor-parallel collective runs inside the runtime's naming (the regions call it with what
  they do and the group's ranks), so a lost peer there becomes a ``PeerLostError`` at once;
* a lost connection raised from inside FSDP2 is read off its traceback (all-gathering parameters,
  or reduce-scattering gradients) and becomes a ``PeerLostError`` naming the data-parallel rank
  that stopped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from lightning_pipe.data_parallel.fsdp_internals import collective_of
from lightning_pipe.faults.board import PeerLostError, lost_connection
from lightning_pipe.faults.naming import CollectiveNaming
from lightning_pipe.tensor_parallel.regions import collectives_named


@contextmanager
def batch_collectives_named(naming: CollectiveNaming, data_ranks: Sequence[int] | None) -> Iterator[None]:
    """Inside the block, a peer lost in a tensor-parallel collective or (``data_ranks``: the
    data-parallel group's global ranks, under FSDP2) in one of FSDP2's raises ``PeerLostError``
    naming the collective and the rank that stopped."""
    with collectives_named(naming):
        try:
            yield
        except PeerLostError:
            raise
        except Exception as err:
            doing = collective_of(err) if data_ranks is not None else None
            if doing is None or data_ranks is None or not lost_connection(str(err)):
                raise
            with naming.lost_peers(doing, data_ranks):
                raise
