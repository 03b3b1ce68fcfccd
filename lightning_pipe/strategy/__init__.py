"""The Lightning adapter: the only part of lightning_pipe that imports ``lightning``.

``"pipe_tp"`` is registered once, by ``import lightning_pipe`` (:mod:`lightning_pipe._registration`:
a factory that imports this package when a Trainer asks for the name), not here;
``--trainer.strategy=lightning_pipe.PipeTPStrategy`` works from LightningCLI by class path.
"""

from lightning_pipe.strategy.pipe_tp import PipeTPStrategy

__all__ = ["PipeTPStrategy"]
