"""Fail together: turn one rank's checkpoint error into the same error on every rank.

Saving and loading are collectives. If one rank's shard file is damaged, or one rank's slice does
not fit, and that rank simply raised, its peers would wait in the next collective until the process
group's timeout (minutes) and then report a timeout instead of the cause. Instead every rank
reports its outcome in one ``all_gather_object`` and all of them raise the same
:class:`CheckpointError`, naming the ranks and their messages, at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_pipe.checkpoint.metadata import CheckpointError


def exchange(
    error: str | None, payload: Any, group: dist.ProcessGroup | None = None
) -> list[tuple[str | None, Any]]:
    """Every rank's ``(error, payload)``, by rank; a no-op list of one without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [(error, payload)]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (error, payload), group=group)
    return out


def describe_failures(errors: list[str | None]) -> str | None:
    """``"ranks [0, 1]: msg; rank 3: other"`` for the ranks that failed, or ``None``."""
    by_message: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            by_message.setdefault(error, []).append(rank)
    if not by_message:
        return None
    return "; ".join(
        f"{'rank ' + str(ranks[0]) if len(ranks) == 1 else 'ranks ' + str(ranks)}: {message}"
        for message, ranks in by_message.items()
    )


def error_text(err: BaseException) -> str:
    """A checkpoint error's own message; any other exception prefixed with its type."""
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


@contextmanager
def fail_together(what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the body on every rank of ``group``; if it raised on any, raise on all.

    The error reads ``"<what> failed on ranks [...]: <message>"``; on a rank that failed itself the
    original exception is chained as the cause.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as err:  # reported to every rank below, then raised on all of them
        error = err
    failures = describe_failures([e for e, _ in exchange(error_text(error) if error else None, None, group)])
    if failures is not None:
        raise CheckpointError(f"{what} failed on {failures}") from error
