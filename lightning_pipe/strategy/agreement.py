"""Stop every rank of a model replica together when its ranks cannot run a step together.

Before each step the ranks of one replica (its pipeline and tensor ranks) agree, in one small
all-reduce, that they hold the same batch for the same step (:mod:`lightning_pipe.pipeline.fingerprint`);
on the first step after setup each also checks that the module's ``forward`` is its pipeline
layers chained (:mod:`lightning_pipe.pipeline.forward_contract`) and a failure rides on the same
all-reduce. At the end of each loop they agree once more, so that a rank whose data ran out first
does not leave its peers waiting in a step.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.pipeline.fingerprint import StepIdentity, agree, fingerprint
from lightning_pipe.pipeline.forward_contract import check_forward
from lightning_pipe.strategy.base import PipeTPParts


class StepAgreement(PipeTPParts):
    """The pre-step checks of ``PipeTPStrategy`` (which provides the mesh, module and layers)."""

    _forward_checked: bool
    check_forward: bool

    def _check_before_step(self, step_name: str, args: tuple[Any, ...], batch: Any, probe: Any) -> None:
        """Stop every rank of the replica, with one message, if its ranks are about to run
        different batches, or (on the first step after setup) if ``forward`` is not the chained
        pipeline layers."""
        module = self.module
        problem = None
        if not self._forward_checked and self.check_forward:
            self._forward_checked = True
            problem, warning = check_forward(module.forward, self.runtime.layers, module, probe)
            if warning is not None:
                rank_zero_warn(warning)
        if step_name == "training_step":
            batch_idx = module.trainer.fit_loop.epoch_loop.batch_idx
        else:
            batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        self._agree(StepIdentity(step_name, batch_idx), batch, problem)

    def _agree(self, step: StepIdentity, batch: Any, problem: str | None = None) -> None:
        """Raise on every rank of the replica unless all hold the same batch for the same step."""
        group = self.mesh.model_group
        if dist.get_world_size(group) == 1:
            if problem is not None:
                raise MisconfigurationException(problem)
            return
        layout = self.mesh.layout

        def describe(rank: int) -> str:
            c = layout.coordinates(rank)
            return f"pp_rank {c.pp_rank}, tp_rank {c.tp_rank}"

        replica = layout.replica_ranks(layout.coordinates(self.global_rank).dp_rank)
        others = [r for r in replica if r != self.global_rank]
        with self._collective(f"checking that the replica's ranks run the same batch ({step})", others):
            agree(fingerprint(batch, step, self.root_device), group, describe, step, batch, problem)

    # A rank whose dataloader ran out first reaches the end of the loop while its peers still run
    # a step: agreeing on "the end" makes both sides stop with the same message.
    @override
    def on_validation_end(self) -> None:
        self._agree(StepIdentity("end of validation", -1), None)
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._agree(StepIdentity("end of test", -1), None)
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._agree(StepIdentity("end of predict", -1), None)
        super().on_predict_end()
