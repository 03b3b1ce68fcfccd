"""A gradient scaler whose inf/NaN check is agreed over every rank of the model (fp16).

Under ``float16`` autocast the loss is scaled before backward and the gradients unscaled before
the step; a step whose gradients hold inf or NaN is skipped and the scale lowered. Each rank of a
pipeline checks only its own stage's gradients, so with torch's ``GradScaler`` one stage could skip
while another steps, and the scales would drift apart: the model would silently stop being one
model. Here the check is one all-reduce over the model's ranks (pipeline and tensor groups)
right after unscaling, before any rank steps, so that all ranks skip or step together and keep
one scale. torch's ``ShardedGradScaler`` does the same for FSDP, with one
all-reduce per device that holds gradients; this one always does exactly one, so a rank whose
optimizer holds no gradient still joins it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose found-inf flag is the OR over ``group``."""

    def __init__(self, device: str, group: dist.ProcessGroup | None, **kwargs: float | int | bool) -> None:
        super().__init__(device, **kwargs)  # type: ignore[arg-type]
        self.group = group
        self._agreed_device = torch.device(device)

    @classmethod
    def like(
        cls, scaler: torch.amp.GradScaler, device: str, group: dist.ProcessGroup | None
    ) -> AgreedGradScaler:
        """A scaler with ``scaler``'s settings and state (scale, growth tracker), agreed over ``group``."""
        agreed = cls(
            device,
            group,
            init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
        state = scaler.state_dict()
        if state:
            agreed.load_state_dict(state)
        # The scale tensor is created by the first scale(): on every rank now, since only the last
        # stage scales losses and every rank unscales.
        agreed.scale(torch.zeros(1, device=device))
        return agreed

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        # The check's result lives in the optimizer's per-step state, where step() and update()
        # read it (torch's own ShardedGradScaler agrees it in the same place).
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros(1, dtype=torch.float32, device=self._agreed_device)
        for value in found.values():
            flag += value.to(flag.device).sum()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        agreed = (flag > 0).float()
        if not found:  # no gradient here: still skip (and back off) with the others
            found[flag.device] = agreed
        for key, value in found.items():
            found[key] = agreed.to(value.device)
