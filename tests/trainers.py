"""Quiet Lightning Trainers for the tests: on the CPU, with no logger, no checkpoints, no progress
bar and no model summary unless a test asks for one.

Plain functions in a module, not pytest fixtures: most fits run inside the ranks that
:func:`tests.distributed.run_distributed` starts, which unpickle the worker function by its module
path and run it without pytest (no fixture can reach them), and ``tests/long_fit.py`` runs as a
script. The single-device references that the tests compare with call the same functions, so both
sides of a comparison build their Trainer alike.
"""

from __future__ import annotations

import tempfile
from typing import Any

import lightning as L

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""What a test Trainer leaves out; a test turns any of it back on by passing it to
:func:`quiet_trainer` or :func:`fit` (``enable_checkpointing=True``, ``logger=CSVLogger(...)``)."""


def quiet_trainer(strategy: Any, devices: int, root: str | None = None, **settings: Any) -> L.Trainer:
    """A CPU ``L.Trainer`` on ``devices`` with :data:`QUIET` and ``default_root_dir=root``;
    ``settings`` (``max_epochs``, ``callbacks``, ``plugins``, ...) add to them or override them."""
    options = {"strategy": strategy, "accelerator": "cpu", "devices": devices, "default_root_dir": root}
    return L.Trainer(**{**options, **QUIET, **settings})


def fit(
    model: L.LightningModule,
    strategy: Any,
    devices: int,
    data: Any = None,
    root: str | None = None,
    ckpt_path: str | None = None,
    val: Any = None,
    **settings: Any,
) -> L.Trainer:
    """``quiet_trainer(strategy, devices, root, **settings).fit(model, data, val, ckpt_path=...)``;
    returns the Trainer. Without ``root`` it writes under a temporary directory, removed when the
    fit returns."""
    if root is None:
        with tempfile.TemporaryDirectory() as tmp:
            return fit(model, strategy, devices, data, tmp, ckpt_path, val, **settings)
    trainer = quiet_trainer(strategy, devices, root, **settings)
    trainer.fit(model, data, val, ckpt_path=ckpt_path)
    return trainer
