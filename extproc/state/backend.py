"""The Redis connection: one script call per batch of operations, bounded by a timeout.

Only this module imports redis-py (the `redis` extra: redis + hiredis). Every failure a caller
can see is a `StateUnavailable`: connection refused or reset, a timeout, a script error
(translated in one place, `_unavailable`). The script is extproc/state/admission.lua.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from importlib.resources import files
from typing import Any

import orjson

from extproc.policy.model import State
from extproc.state.ops import Op, Reply, encode

SCRIPT_RESOURCE = "admission.lua"


class StateUnavailable(Exception):
    """The shared store did not answer in time (or at all)."""


def _redis() -> Any:
    try:
        import redis.asyncio as redis_asyncio
    except ImportError as error:  # pragma: no cover - the redis extra is not installed
        raise RuntimeError(
            "state.backend is redis but redis-py is not installed: pip install redis hiredis"
        ) from error
    return redis_asyncio


def script_text() -> str:
    """The Lua script every batch runs in (package data next to this module)."""
    return files("extproc.state").joinpath(SCRIPT_RESOURCE).read_text(encoding="utf-8")


@contextlib.contextmanager
def _unavailable(what: str) -> Iterator[None]:
    """Every way the store can fail, as the one exception callers handle."""
    try:
        yield
    except (TimeoutError, OSError) as error:
        raise StateUnavailable(f"{what}: {error!r}") from error
    except Exception as error:
        if _is_redis_error(error):
            raise StateUnavailable(f"{what}: {error}") from error
        raise


class RedisBackend:
    """Runs batches of operations (extproc.state.ops) against one Redis server."""

    def __init__(self, settings: State, replica: str, *, time_override: float | None = None):
        redis_asyncio = _redis()
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.settings = settings
        self.replica = replica
        self.prefix = settings.key_prefix + ":"
        self.channel = self.prefix + "ev"
        self.time_override = time_override
        """Tests only: run the script at this server time (seconds) instead of TIME."""
        timeout = settings.timeout
        # Our own timeout bounds every call; redis-py must not retry behind our back.
        self.client = redis_asyncio.Redis.from_url(
            settings.url,
            socket_timeout=max(timeout * 4, 1.0),
            socket_connect_timeout=max(timeout * 4, 0.5),
            retry=Retry(NoBackoff(), 0),
            max_connections=64,
            client_name=f"extproc-{replica}",
        )
        self._script = self.client.register_script(script_text())
        self._static_args = [
            str(int(settings.lease_ttl * 1000)),
            str(int(settings.backlog_ttl * 1000)),
        ]

    async def run(self, ops: Sequence[Op], timeout: float | None = None) -> list[Reply]:
        """Apply `ops` atomically, in order; one reply per operation."""
        at = "" if self.time_override is None else repr(self.time_override)
        wire = orjson.dumps([encode(op) for op in ops])
        args = [self.prefix, wire, self.replica, *self._static_args, at]
        with _unavailable("redis did not answer"):
            raw = await asyncio.wait_for(
                self._script(args=args), self.settings.timeout if timeout is None else timeout
            )
        replies = orjson.loads(raw)
        if not isinstance(replies, list) or len(replies) != len(ops):
            raise StateUnavailable(f"unexpected reply from the state script: {raw!r:.200}")
        return [r if isinstance(r, dict) else {} for r in replies]

    async def ping(self, timeout: float) -> None:
        with _unavailable("redis did not answer"):
            await asyncio.wait_for(self.client.ping(), timeout)

    async def events(self) -> AsyncIterator[str]:
        """Messages on the event channel until the connection fails (then StateUnavailable)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            with _unavailable("event subscription lost"):
                await asyncio.wait_for(
                    pubsub.subscribe(self.channel), max(self.settings.timeout, 1)
                )
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    data = message.get("data")
                    if isinstance(data, bytes):
                        yield data.decode("utf-8", "replace")
        finally:
            with contextlib.suppress(Exception):  # closing a broken connection may fail
                await asyncio.wait_for(pubsub.aclose(), 1.0)

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken connection may fail
            await asyncio.wait_for(self.client.aclose(), 1.0)


def _is_redis_error(error: BaseException) -> bool:
    from redis.exceptions import RedisError

    return isinstance(error, RedisError)
