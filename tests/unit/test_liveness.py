"""The supervisor's liveness watch (extproc.service.liveness): where it asks, and when a
silent worker is overdue."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from extproc.service.liveness import STARTING_GRACE_S, LivenessWatch, healthz_url
from tests.conftest import free_port, health_endpoint


def test_healthz_url() -> None:
    assert healthz_url("127.0.0.1:9090") == "http://127.0.0.1:9090/healthz"
    assert healthz_url("0.0.0.0:9091") == "http://127.0.0.1:9091/healthz"
    assert healthz_url("[::]:9092") == "http://[::1]:9092/healthz"
    assert healthz_url("[::1]:9093") == "http://[::1]:9093/healthz"
    assert healthz_url("127.0.0.1:0") is None  # the kernel's choice: not known here


@pytest.fixture
def healthz() -> Iterator[str]:
    with health_endpoint("/healthz") as url:
        yield url + "/healthz"


def test_a_silent_worker_gets_the_start_grace_then_is_overdue() -> None:
    watch = LivenessWatch(f"http://127.0.0.1:{free_port()}/healthz", timeout_s=2.0)
    try:
        now = time.monotonic()
        assert watch.overdue(now) is None  # never answered: still starting
        late = watch.overdue(now + STARTING_GRACE_S + 1)
        assert late is not None and late > STARTING_GRACE_S
        watch.restarted(now + STARTING_GRACE_S + 1)  # a new process: the grace again
        assert watch.overdue(now + STARTING_GRACE_S + 2) is None
    finally:
        watch.stop()


def test_an_answering_worker_is_overdue_only_after_the_timeout(healthz: str) -> None:
    watch = LivenessWatch(healthz, timeout_s=3.0, interval_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while watch.answered_at is None:
            assert time.monotonic() < deadline, "the watch never heard an answer"
            time.sleep(0.02)
        now = watch.answered_at
        assert watch.overdue(now + 2.0) is None
        silent = watch.overdue(now + 10.0)
        assert silent is not None and silent > 3.0
    finally:
        watch.stop()
