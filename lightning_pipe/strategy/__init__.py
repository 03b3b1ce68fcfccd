"""The Lightning adapter: the only part of lightning_pipe that imports ``lightning``.

``"pipe_tp"`` is registered with Lightning once, by :mod:`lightning_pipe._registration` (run by
``import lightning_pipe``, which any import of this package runs first): a factory that imports
this package when a Trainer asks for the name. ``--trainer.strategy=lightning_pipe.PipeTPStrategy``
works from LightningCLI by class path.
"""

from lightning_pipe.strategy.pipe_tp import PipeTPStrategy

__all__ = ["PipeTPStrategy"]
