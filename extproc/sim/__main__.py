"""`python -m extproc.sim [plan] ...`: the simulator without the top-level CLI."""

import sys

from extproc.sim.cli import run

sys.exit(run())
