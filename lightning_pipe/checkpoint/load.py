"""``load_from_checkpoint(MyModel, path)``: a checkpoint of any kind into a plain module, one call.

``LightningModule.load_from_checkpoint`` opens a file; a sharded ``pipe_tp`` checkpoint is a
directory (``IsADirectoryError``). This consolidates the directory's weights in memory (one
process, no torch.distributed, memory for the whole model) and hands the result to the module's
own ``load_from_checkpoint``, so hyper-parameters, ``configure_model()``, ``on_load_checkpoint``,
``strict`` and ``map_location`` behave exactly as for a file. A file is passed straight through.
Every sharded checkpoint also holds a ``HOW_TO_LOAD.txt`` pointing here, for whoever meets that
error and looks inside.
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_pipe.checkpoint.single_file import consolidate_checkpoint

M = TypeVar("M")


def load_from_checkpoint(
    cls: type[M],
    path: str | Path,
    map_location: Any = None,
    strict: bool | None = None,
    trust_pickle: bool = False,
    **kwargs: Any,
) -> M:
    """``cls.load_from_checkpoint(path, ...)`` for a sharded ``pipe_tp`` directory as well as a file.

    ``cls`` is a LightningModule class; ``kwargs`` override saved hyper-parameters, as in
    Lightning. ``trust_pickle=True`` reads hyper-parameters that hold arbitrary objects
    (``torch.load(weights_only=False)``): only for checkpoints you trust.
    """
    loader = getattr(cls, "load_from_checkpoint", None)
    if not callable(loader):
        raise TypeError(
            f"load_from_checkpoint needs a LightningModule class, got {cls!r}; for a plain nn.Module use "
            "consolidate_checkpoint(path)['state_dict'] with load_state_dict."
        )
    if trust_pickle and "weights_only" in inspect.signature(loader).parameters:
        kwargs["weights_only"] = False  # Lightning >= 2.5; older versions read without the flag
    if not Path(path).is_dir():
        return loader(path, map_location=map_location, strict=strict, **kwargs)
    # A directory is read as a sharded checkpoint whatever it holds: one without its metadata gets
    # the explanation that fit and consolidate give, not Lightning's IsADirectoryError.
    checkpoint = consolidate_checkpoint(path, weights_only=True, trust_pickle=trust_pickle)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    return loader(buffer, map_location=map_location, strict=strict, **kwargs)
