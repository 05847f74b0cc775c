"""`python -m gateway_lab.sim [plan] ...`: the simulator without the top-level CLI."""

import sys

from gateway_lab.sim.cli import run

sys.exit(run())
