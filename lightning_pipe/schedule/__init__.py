"""Pipeline schedules as data: the action IR, the builders, their lowering to communication, the
validator, the simulator, the text and timeline renderings and the ``python -m
lightning_pipe.schedule`` command.

Nothing here runs a model or talks to another process: a schedule is built, checked and timed on
paper, in one process; :mod:`lightning_pipe.execution` runs it.
"""
