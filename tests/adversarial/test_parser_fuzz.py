"""The coverage-guided fuzzer (tests/fuzz_parsers.py) over the request, path and usage
parsers, bounded for CI: each target a fixed number of inputs within a time bound, in its own
process (libFuzzer runs once per process). Any exception other than the ones allowed, a
broken invariant or an input slower than the per-input timeout fails the run."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_support import REPO

RUNS = {"request": 300_000, "path": 100_000, "sse": 20_000}
"""Inputs per target: about 5 s each on one core."""
MAX_TIME_S = 30


@pytest.fixture(scope="module", autouse=True)
def atheris_installed() -> None:
    if importlib.util.find_spec("atheris") is None:
        message = "atheris is missing: pip install -e '.[test]'"
        wheels = sys.platform == "linux" and platform.machine() == "x86_64"
        if wheels and os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)  # the test extra has it where atheris has wheels
        pytest.skip(message)


@pytest.mark.parametrize("target", sorted(RUNS))
def test_fuzzed_inputs_raise_nothing_unexpected(target: str, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "tests.fuzz_parsers", target, "--runs", str(RUNS[target]),
        "--max-time", str(MAX_TIME_S), "--artifacts", str(tmp_path),
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True,
        timeout=MAX_TIME_S + 60,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert not list(tmp_path.iterdir()), output[-4000:]  # no crash-* / timeout-* input
    ran = re.search(r"Done (\d+) runs", output)
    assert ran is not None, output[-4000:]
    # Not a run cut short by the time bound before it got anywhere.
    assert int(ran.group(1)) >= min(RUNS[target], 1000), output[-2000:]
