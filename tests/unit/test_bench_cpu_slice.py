"""gateway_lab.bench.cpu_slice: a shorter CPU slice, asked for without privilege, inherited by
threads and across exec. Run in child processes, so pytest keeps its own slice."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway_lab.bench.cpu_slice import MAX_SLICE_US, MIN_SLICE_US, current_slice_us, set_cpu_slice

pytestmark = pytest.mark.skipif(
    current_slice_us() is None, reason="sched_getattr is Linux x86_64 only"
)

READ_IN_A_NEW_THREAD = """
import threading
from gateway_lab.bench.cpu_slice import current_slice_us, set_cpu_slice
before = current_slice_us()
took = set_cpu_slice({us})
seen = []
thread = threading.Thread(target=lambda: seen.append(current_slice_us()))
thread.start()
thread.join()
print(before, took, current_slice_us(), seen[0])
"""


def run_python(code: str) -> str:
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def test_the_slice_is_set_and_a_thread_started_after_inherits_it() -> None:
    before, took, now, thread = run_python(READ_IN_A_NEW_THREAD.format(us=250)).split()
    if took != "True":
        pytest.skip(f"this kernel keeps its own slice ({before} us)")
    assert int(before) != 250
    assert (now, thread) == ("250", "250")


def test_the_launcher_runs_a_program_with_the_slice() -> None:
    read = "from gateway_lab.bench.cpu_slice import current_slice_us; print(current_slice_us())"
    launcher = [sys.executable, "-m", "gateway_lab.bench.cpu_slice", "300", "--"]
    command = [*launcher, sys.executable, "-c", read]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    if "keeps its own slice" in done.stderr:
        pytest.skip("this kernel keeps its own slice")
    assert done.stdout.strip() == "300"


def test_the_launcher_refuses_a_malformed_command_line() -> None:
    for args, says in (
        (["100"], "usage:"),
        (["abc", "--", "true"], "usage:"),
        (["100", "true"], "usage:"),
        (["5", "--", "true"], "a slice is 100-100000 us, not 5"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "gateway_lab.bench.cpu_slice", *args],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 2 and says in done.stderr


@pytest.mark.parametrize("us", [MIN_SLICE_US - 1, MAX_SLICE_US + 1, 0])
def test_a_slice_outside_the_kernels_range_is_refused(us: int) -> None:
    with pytest.raises(ValueError, match="a slice is"):
        set_cpu_slice(us)
