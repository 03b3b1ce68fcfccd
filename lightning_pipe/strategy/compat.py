"""Where ``PipeTPStrategy`` has to read Lightning's private state, in one place.

Each function names the Lightning behaviour it works around, so that it can be removed when
Lightning changes.
"""

from __future__ import annotations

import inspect

from lightning.pytorch import Trainer


def weights_only_of_running_call() -> bool | None:
    """The ``weights_only`` given to the running ``trainer.fit/validate/test/predict`` call.

    A strategy that restores after setup (``restore_checkpoint_after_setup``, as this one must:
    each rank loads only its own stage's part) is asked to load without it: ``Trainer._run`` calls
    ``_restore_modules_and_callbacks(ckpt_path)`` and drops the argument (Lightning 2.6). It is
    still a local of that ``Trainer._run`` frame.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "_run" and isinstance(frame.f_locals.get("self"), Trainer):
                value = frame.f_locals.get("weights_only")
                return value if isinstance(value, bool) else None
            frame = frame.f_back
        return None
    finally:
        del frame
