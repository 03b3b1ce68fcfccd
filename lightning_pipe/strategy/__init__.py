"""The Lightning adapter: the only part of lightning_pipe that imports ``lightning``.

Importing it registers the strategy name ``"pipe_tp"`` so that ``Trainer(strategy="pipe_tp")``
works; ``--trainer.strategy=lightning_pipe.PipeTPStrategy`` works from LightningCLI by class path.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.strategy.pipe_tp import PipeTPStrategy

if PipeTPStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        PipeTPStrategy.strategy_name,
        PipeTPStrategy,
        description="Pipeline (GPipe/1F1B) x tensor x data parallelism from lightning_pipe",
    )

__all__ = ["PipeTPStrategy"]
