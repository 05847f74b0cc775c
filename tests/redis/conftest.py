"""Fixtures for the shared-state tests: each test gets its own redis-server.

No redis-server binary: the tests skip with a message, except in CI (CI=true), where they
fail: CI installs redis-server (.ci/run) and must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.redis.support import RedisServer, redis_binary


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = redis_binary()
    if binary is None:
        message = "redis-server not found: apt-get install redis-server to run the redis tests"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
    server = RedisServer(binary)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()
