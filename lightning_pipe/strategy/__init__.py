"""The Lightning adapter: the only part of lightning_pipe that imports ``lightning``.

Importing it registers :class:`PipeTPStrategy` under ``"pipe_tp"`` (``import lightning_pipe``
already registers a factory that imports this package when a Trainer asks for the name);
``--trainer.strategy=lightning_pipe.PipeTPStrategy`` works from LightningCLI by class path.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe._registration import DESCRIPTION, NAME
from lightning_pipe.strategy.pipe_tp import PipeTPStrategy

StrategyRegistry.register(NAME, PipeTPStrategy, description=DESCRIPTION, override=True)

__all__ = ["PipeTPStrategy"]
