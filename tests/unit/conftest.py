"""The `fairness` fixture: every conformance test runs once per registered fair-share policy."""

from __future__ import annotations

import pytest
from sched_support import FAIRNESS


@pytest.fixture(params=FAIRNESS)
def fairness(request: pytest.FixtureRequest) -> str:
    return str(request.param)
