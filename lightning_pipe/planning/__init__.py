"""Choosing a layout from measurements: the candidates ``pipe_tp`` can run on a number of processes
(:mod:`.candidates`), what the cost model is told (:mod:`.costs`), the cost model itself
(:mod:`.cost_model`: step time through the schedule simulator, peak memory per rank), the choice
(:mod:`.planner`), the measurements on one device (:mod:`.measure`), the probe of a process group's
links (:mod:`.links`) and the table a person reads (:mod:`.report`). ``python -m
lightning_pipe.plan`` prints a plan; ``layout="auto"`` (:mod:`.auto`) decides with it in a run.

Plain torch: nothing here starts a process group or imports Lightning (the probe runs in one it
is given).
"""

from lightning_pipe.planning.candidates import (
    Candidate,
    Constraints,
    DataMode,
    ModelShape,
    enumerate_candidates,
)
from lightning_pipe.planning.cost_model import MemoryUse, Prediction, predict
from lightning_pipe.planning.costs import LayerCost, Links, Machine, ModelCosts
from lightning_pipe.planning.planner import NothingFitsError, Plan, plan_layout
from lightning_pipe.planning.report import format_table, render, why

__all__ = [
    "Candidate",
    "Constraints",
    "DataMode",
    "LayerCost",
    "Links",
    "Machine",
    "MemoryUse",
    "ModelCosts",
    "ModelShape",
    "NothingFitsError",
    "Plan",
    "Prediction",
    "enumerate_candidates",
    "format_table",
    "plan_layout",
    "predict",
    "render",
    "why",
]
