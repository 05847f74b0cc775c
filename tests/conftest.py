"""Shared test helpers: small synthetic policies built in the test, never shared data."""

from __future__ import annotations

import socket

from extproc.policy import hash_key

TEST_KEYS = {"acme": "key-acme", "globex": "key-globex", "initech": "key-initech"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
