"""Building only what a rank owns: parameters on the meta device, materialised per stage.

:mod:`~lightning_pipe.construction.meta` creates a model's parameters without storage;
:mod:`~lightning_pipe.construction.materialize` gives this rank's stage (and tensor slice) its
storage and initial values, the same values whatever the layout.
"""
