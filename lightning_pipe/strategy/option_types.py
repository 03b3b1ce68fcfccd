"""Types for the strategy's options that LightningCLI checks while it parses.

LightningCLI (jsonargparse) builds the strategy only after the whole command line and every config
file are parsed; a value the constructor refuses then surfaces as two chained tracebacks and a
dump of every option, with the one sentence that names the problem buried inside. jsonargparse
checks some types itself, at parse time, and reports a failure as one ``error:`` line naming the
option: its restricted number types (``jsonargparse.typing.PositiveInt`` ...). Annotating the sizes
and counts with them moves the refusal of ``pipeline_parallel_size: -1`` to the parser.

jsonargparse is not a dependency of ``lightning_pipe`` (nor of ``lightning``: it comes with
``lightning[pytorch-extra]`` or ``jsonargparse[signatures]``, which LightningCLI needs). Without it
these names are plain ``int`` / ``float``: nothing parses a command line then, and the constructor's
own checks (:mod:`lightning_pipe.arguments`) still refuse every bad value with the same sentence.
Type checkers see the plain types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["PositiveFloat", "PositiveInt"]

if TYPE_CHECKING:
    PositiveInt = int
    PositiveFloat = float
else:
    try:
        from jsonargparse.typing import PositiveFloat, PositiveInt
    except ImportError:  # no LightningCLI in this environment: the constructor checks alone
        PositiveInt = int
        PositiveFloat = float
