"""What the parts of ``PipeTPStrategy`` share: the mesh, the module, the rank's stage, collectives.

``PipeTPStrategy`` is assembled from parts that each own one concern (checkpoints, model
preparation, the pre-step agreement) and are written against this interface; the strategy itself
provides the implementations.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy

from lightning_pipe.mesh import ParallelMesh
from lightning_pipe.pipeline.timeline import TimelineRecorder
from lightning_pipe.runtime import ParallelRuntime


class PipeTPParts(DDPStrategy):
    """The interface of ``PipeTPStrategy`` that its parts use."""

    @property
    def mesh(self) -> ParallelMesh:
        raise NotImplementedError

    @property
    def runtime(self) -> ParallelRuntime:
        """The plain-torch runtime this strategy adapts Lightning's hooks onto."""
        raise NotImplementedError

    @property
    def module(self) -> LightningModule:
        raise NotImplementedError

    @property
    def pp_rank(self) -> int:
        raise NotImplementedError

    @property
    def is_last_stage(self) -> bool:
        raise NotImplementedError

    def _check_before_step(self, step_name: str, args: tuple[Any, ...], batch: Any, probe: Any) -> None:
        raise NotImplementedError

    def _naming_first_failure(self, kind: type[BaseException]) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _timeline_recorder(self, step: int) -> TimelineRecorder | None:
        raise NotImplementedError

    def _lost_peers(self, what: str, peers: Sequence[int] = ()) -> AbstractContextManager[None]:
        """Turn a lost connection inside the block into an error naming the rank that stopped."""
        raise NotImplementedError

    def _collective(self, what: str, peers: Sequence[int] = ()) -> AbstractContextManager[None]:
        """Name this rank and ``what`` (and ``peers``, on a lost connection) in any error a
        collective inside the block raises."""
        raise NotImplementedError
