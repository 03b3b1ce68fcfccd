"""Ready LightningModules (they import Lightning, like :mod:`lightning_pipe.strategy`)."""

from lightning_pipe.modules.causal_lm import CausalLMModule

__all__ = ["CausalLMModule"]
