"""The supervisor's watch on its workers' liveness (`extproc serve --workers N`).

A worker that crashes is restarted because it exits. One that hangs does not exit: its event
loop blocked, or the process stopped, it holds its gRPC port while Envoy's streams to it time
out one by one (a 503 for each, after `gateway.message_timeout`). Its admin server runs on the
same event loop, so `/healthz` stops answering too: a worker that has not answered for
`timeout_s` is killed, and the supervisor restarts it as after a crash. With one process per
pod, Kubernetes' liveness probe on `/healthz` does the same job; inside one pod, only worker 0
has that probe.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request

from extproc.envoy_config import bracketed, split_host_port

LIVENESS_TIMEOUT_S = 10.0
"""The default: twice `gateway.message_timeout`'s default, so a loop silent this long has failed
every stream Envoy sent it meanwhile."""
log = logging.getLogger("extproc.workers")

STARTING_GRACE_S = 60.0
"""How long a new worker may take to answer `/healthz` the first time (imports, on a loaded
host): the timeout applies from its first answer."""


def healthz_url(admin: str) -> str | None:
    """Where to ask a worker listening on `admin`; None when its port is not known (0)."""
    host, port = split_host_port(admin)
    if port == 0:
        return None
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://{bracketed(host)}:{port}/healthz"


def answers(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LivenessWatch:
    """Asks one worker's `/healthz` every `interval_s` on a thread of its own (a hung worker
    must not stall the supervisor's loop); `overdue` says when to kill it."""

    def __init__(self, url: str, timeout_s: float, interval_s: float = 1.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._started_at = time.monotonic()
        self._answered_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness {url}", daemon=True)
        self._thread.start()

    def restarted(self, now: float) -> None:
        """A new process on the same address: it gets the start-up grace again."""
        with self._lock:
            self._started_at, self._answered_at = now, None

    @property
    def answered_at(self) -> float | None:
        """When the current process last answered (monotonic), if it has."""
        with self._lock:
            return self._answered_at

    def overdue(self, now: float) -> float | None:
        """Seconds since the worker last answered, if that is past its limit; else None."""
        with self._lock:
            if self._answered_at is None:
                silent = now - self._started_at
                return silent if silent > max(STARTING_GRACE_S, self.timeout_s) else None
            silent = now - self._answered_at
        return silent if silent > self.timeout_s else None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            asked_at = time.monotonic()
            if answers(self.url, timeout_s=min(self.interval_s, self.timeout_s)):
                with self._lock:
                    current = asked_at >= self._started_at  # not the previous process's answer
                    first = current and self._answered_at is None
                    if current:
                        self._answered_at = asked_at
                if first:  # from now on, silence longer than the timeout kills it
                    log.info("%s answers: watched", self.url)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - asked_at)))
