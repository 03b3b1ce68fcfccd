"""The pipeline transport on gloo posts on the process group directly (not through
``batch_isend_irecv``): every wire dtype, complex ones included (sent as their real view, as
``isend`` does), arrives intact, both ways in one exchange, with a header the first time and from
the header cache after; the peer's group rank is looked up once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_pipe.execution.p2p import P2PTransport, RecvRequest, SendRequest
from lightning_pipe.execution.wire import _DTYPES, ActivationMeta
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _payload(rank: int, step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * rank + step)
    out = []
    for k, dtype in enumerate(_DTYPES):
        shape = (2, k + 1)
        if dtype.is_complex:
            out.append(
                torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
            )
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif dtype is torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        else:
            out.append(torch.randint(0, 100, shape, generator=g).to(dtype))
    return tuple(out)


def _exchange_every_dtype() -> dict[str, Any]:
    rank = dist.get_rank()
    peer = 1 - rank
    transport = P2PTransport(torch.device("cpu"))
    received = []
    for step in range(3):  # the first exchange carries a header, the next ones use the cache
        mine = _payload(rank, step)
        send = SendRequest(peer, mine, meta=ActivationMeta.of(mine), cache_key="boundary")
        recv = RecvRequest(peer, cache_key="boundary")
        transport.exchange([send], [recv])
        received.append(recv.result)
    transport.flush()
    expected = [_payload(peer, step) for step in range(3)]
    same = all(
        a.dtype == b.dtype and torch.equal(a, b)
        for got, want in zip(received, expected, strict=True)
        for a, b in zip(got, want, strict=True)
    )
    return {"same": same, "direct": transport._direct is not None, "headers": transport.headers_sent}


def test_gloo_exchange_posts_directly_and_delivers_every_dtype() -> None:
    results = run_distributed(_exchange_every_dtype, 2)
    for result in results:
        assert result == {"same": True, "direct": True, "headers": 1}
