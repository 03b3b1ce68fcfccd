"""Entry point of ``python -m lightning_pipe.schedule`` (see the package docstring)."""

from lightning_pipe.schedule.cli import main

raise SystemExit(main())
