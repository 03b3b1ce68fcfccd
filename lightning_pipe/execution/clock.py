"""One clock origin for every rank of a group, as NTP does it: each rank measures its
``time.perf_counter()`` offset to the group's first rank by ping-pong exchanges, because ranks
leave a barrier up to milliseconds apart, more than a forward often takes
(:meth:`~lightning_pipe.execution.timeline.TimelineRecorder.start`).

On NCCL a ``recv`` returns when it is queued, not when the message has arrived: read right after
it, the clock would be early by however long the message takes (docs/gpu.md, F3). Each receive is
therefore followed by a wait for the device (:func:`_arrived`) before the clock is read; this runs
when a recording starts, never inside a step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def common_origin(group: dist.ProcessGroup | None, samples: int = 8) -> tuple[float, float]:
    """Group rank 0's ``perf_counter()`` now, expressed in this rank's clock, and the estimate's
    error bound: rank 0 read its clock between this rank's send and receive, so the offset is off
    by at most half the round trip kept. A collective over ``group``."""
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    root = dist.get_global_rank(group, 0) if group is not None else 0
    me = dist.get_rank(group)
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    dist.barrier(group=group)
    offset, error = 0.0, 0.0  # this rank's clock minus the root's, and how far off it may be
    if me == 0:
        for peer in range(1, dist.get_world_size(group)):
            peer_rank = dist.get_global_rank(group, peer) if group is not None else peer
            for _ in range(samples):
                dist.recv(buf, peer_rank, group=group)
                _arrived(device)
                buf.fill_(time.perf_counter())
                dist.send(buf, peer_rank, group=group)
    else:
        best = float("inf")
        for _ in range(samples):
            sent = time.perf_counter()
            dist.send(buf, root, group=group)
            dist.recv(buf, root, group=group)
            _arrived(device)
            back = time.perf_counter()
            if back - sent < best:
                best, offset = back - sent, (sent + back) / 2 - float(buf.item())
        error = best / 2
    origin = torch.tensor([time.perf_counter() if me == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(origin, root, group=group)
    return float(origin.item()) + offset, error


def _arrived(device: torch.device) -> None:
    """Return once what was received on ``device`` is there (on CUDA, a queued ``recv`` has only
    made the stream wait; on a CPU, gloo's ``recv`` has already returned with the message)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
