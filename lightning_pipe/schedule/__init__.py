"""Pipeline schedules as data: the action IR, the builders, their lowering to communication, the
validator, the simulator, the text and timeline renderings and the ``python -m
lightning_pipe.schedule`` command.

Nothing here runs a model or talks to another process: a schedule is built, checked and timed on
paper, in one process; :mod:`lightning_pipe.execution` runs it.
"""

from lightning_pipe.schedule.actions import Action, ActionType, PipelineSchedule, ScheduleError
from lightning_pipe.schedule.builders import ScheduleKind, build_schedule
from lightning_pipe.schedule.render import render_schedule
from lightning_pipe.schedule.simulate import SimulationResult, simulate
from lightning_pipe.schedule.validate import validate_schedule

__all__ = [
    "Action",
    "ActionType",
    "PipelineSchedule",
    "ScheduleError",
    "ScheduleKind",
    "SimulationResult",
    "build_schedule",
    "render_schedule",
    "simulate",
    "validate_schedule",
]
