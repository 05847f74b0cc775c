"""Shared test helpers: small synthetic policies built in the test, never shared data."""

from __future__ import annotations

import contextlib
import http.server
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from extproc.policy import hash_key


@contextlib.contextmanager
def health_endpoint(path: str) -> Iterator[str]:
    """A loopback HTTP server answering 200 on `GET path` (404 elsewhere), for probes under
    test; yields its base URL."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == path else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


TEST_KEYS = {"acme": "key-acme", "globex": "key-globex", "initech": "key-initech"}


_PORTS_HANDED_OUT: set[int] = set()
_LOWEST_PICKED_PORT = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def free_port() -> int:
    """A loopback port nothing listens on, for a server a test starts next.

    Picked below the kernel's ephemeral range: a port the kernel picked (bind to port 0) and
    we released could be handed to a client connection's local end before our server binds
    it. Never the same port twice in one test run."""
    low, _ = _ephemeral_range()
    if low - _LOWEST_PICKED_PORT >= 1_000:
        for _ in range(200):
            port = random.randrange(_LOWEST_PICKED_PORT, low)
            if port in _PORTS_HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _PORTS_HANDED_OUT.add(port)
    return port


def policy_yaml(
    short_endpoint: str = "127.0.0.1:8001",
    long_endpoint: str = "127.0.0.1:8002",
    extra: str = "",
    acme_limits: str = "{requests_per_minute: 600, tokens_per_minute: 1000000, max_queued: 64}",
    globex_limits: str = "{requests_per_minute: 600, tokens_per_minute: 1000000, max_queued: 64}",
    initech_limits: str = "{requests_per_minute: 600, tokens_per_minute: 1000000, max_queued: 64}",
    short_inflight: int = 64,
    long_inflight: int = 8,
) -> str:
    """The pools run on one static limit (no headroom, no adaptive limit), which the tests
    using this policy were written for; tests/unit/test_policy_defaults.py covers the
    defaults."""
    static = "\n    headroom: 0\n    adaptive: {enabled: false}"
    return f"""\
version: 1
tiers: [premium, standard, batch]
tenants:
  acme:
    tier: premium
    api_keys: ["{hash_key(TEST_KEYS["acme"])}"]
    limits: {acme_limits}
  globex:
    tier: standard
    weight: 1.0
    api_keys: ["{hash_key(TEST_KEYS["globex"])}"]
    limits: {globex_limits}
  initech:
    tier: standard
    weight: 1.0
    api_keys: ["{hash_key(TEST_KEYS["initech"])}"]
    limits: {initech_limits}
pools:
  short:
    max_total_tokens: 2048
    max_inflight: {short_inflight}
    max_inflight_tokens: 400000
    endpoints: ["{short_endpoint}"]{static}
  long:
    max_total_tokens: 16384
    max_inflight: {long_inflight}
    max_inflight_tokens: 600000
    endpoints: ["{long_endpoint}"]{static}
{extra}"""


def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    """Attach the logs of every running data-plane child to a failing test's report."""
    if call.when != "call" or call.excinfo is None:
        return
    from tests.dataplane.harness import ACTIVE_STACKS

    for stack in ACTIVE_STACKS:
        for child in stack.children:
            item.add_report_section("call", f"log of {child.name}", child.log_tail(80))
