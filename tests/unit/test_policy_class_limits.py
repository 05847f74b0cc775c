"""Limits per endpoint class and bursts in the policy file: what they mean, how they are
checked (file:line like every key), and what `extproc policy check` says about them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.policy import PolicyError, policy_from_text
from extproc.policy.limits import describe_limits, limit_warnings
from extproc.policy.model import BucketLimits, Limits


def _text(limits: str) -> str:
    return f"""\
version: 1
tiers: [gold]
tenants:
  a:
    tier: gold
    limits:
{limits}
  b: {{tier: gold, limits: {{max_queued: 10}}}}
pools:
  p: {{max_total_tokens: 1000, max_inflight: 4, max_inflight_tokens: 4000,
       endpoints: ["127.0.0.1:1"]}}
"""


EXAMPLE = """\
      requests_per_minute: 600
      requests_burst: 20
      tokens_per_minute: 200000
      max_concurrency: 32
      per_endpoint:
        chat: {requests_per_minute: 300}
        embeddings: {tokens_per_minute: 150000, tokens_burst: 40000, max_concurrency: 4}"""


def issues_of(limits: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        policy_from_text(_text(limits), "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def test_per_endpoint_blocks_and_bursts_parse() -> None:
    limits = policy_from_text(_text(EXAMPLE)).tenants["a"].limits
    assert (limits.requests_per_minute, limits.requests_burst) == (600, 20)
    assert (limits.tokens_per_minute, limits.tokens_burst) == (200000, None)
    assert limits.per_endpoint == {
        "chat": BucketLimits(requests_per_minute=300),
        "embeddings": BucketLimits(tokens_per_minute=150000, tokens_burst=40000, max_concurrency=4),
    }


def test_the_defaults_are_todays_limits() -> None:
    assert Limits() == Limits(per_endpoint={}, requests_burst=None, tokens_burst=None)
    assert policy_from_text(_text("      max_queued: 5")).tenants["a"].limits.per_endpoint == {}


def test_an_unknown_class_is_rejected_at_its_line() -> None:
    text = EXAMPLE.replace("embeddings:", "embedding:")
    assert issues_of(text) == [
        "p.yaml:13: tenants.a.limits.per_endpoint.embedding: unknown key; use 'chat', "
        "'completions', 'embeddings' or 'rerank'"
    ]


def test_an_unknown_key_in_a_class_block_is_rejected_at_its_line() -> None:
    text = EXAMPLE.replace("{requests_per_minute: 300}", "{requests_per_minute: 300, rpm: 3}")
    assert issues_of(text) == ["p.yaml:12: tenants.a.limits.per_endpoint.chat.rpm: unknown key"]
    assert issues_of(EXAMPLE.replace("max_concurrency: 32", "max_queued_per_class: 3")) == [
        "p.yaml:10: tenants.a.limits.max_queued_per_class: unknown key"
    ]


def test_queue_settings_are_tenant_wide_only() -> None:
    text = EXAMPLE.replace("{requests_per_minute: 300}", "{max_queued: 3}")
    assert issues_of(text) == [
        "p.yaml:12: tenants.a.limits.per_endpoint.chat.max_queued: unknown key"
    ]


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "'20'"])
def test_a_burst_is_a_whole_number_of_at_least_one(value: str) -> None:
    (issue,) = issues_of(EXAMPLE.replace("requests_burst: 20", f"requests_burst: {value}"))
    assert issue.startswith("p.yaml:8: tenants.a.limits.requests_burst: ")


def test_a_burst_needs_its_rate_and_stays_within_it() -> None:
    assert issues_of(EXAMPLE.replace("      requests_per_minute: 600\n", "")) == [
        "p.yaml:7: tenants.a.limits.requests_burst: needs requests_per_minute (the rate its "
        "bucket refills at)"
    ]
    assert issues_of(EXAMPLE.replace("tokens_burst: 40000", "tokens_burst: 150001")) == [
        "p.yaml:13: tenants.a.limits.per_endpoint.embeddings.tokens_burst: 150001 exceeds "
        "tokens_per_minute 150000: a bucket holding more than a minute's limit would let "
        "more than the limit through in a minute"
    ]
    # equal is a whole minute: the default, spelled out
    equal = EXAMPLE.replace("tokens_burst: 40000", "tokens_burst: 150000")
    assert policy_from_text(_text(equal)).tenants["a"].limits.per_endpoint["embeddings"]


def test_every_issue_is_reported_at_once() -> None:
    text = EXAMPLE.replace("requests_burst: 20", "requests_burst: 601").replace(
        "{requests_per_minute: 300}", "{requests_burst: 3}"
    )
    assert [issue.split(": ")[1] for issue in issues_of(text)] == [
        "tenants.a.limits.requests_burst",
        "tenants.a.limits.per_endpoint.chat.requests_burst",
    ]


def test_policy_check_describes_each_tenants_buckets() -> None:
    source = policy_from_text(_text(EXAMPLE)).source
    assert describe_limits(source) == [
        "tenant a: every request: requests 600/min (burst 20), tokens 200000/min (burst "
        "200000: a whole minute, default), concurrency 32; chat also: requests 300/min (burst "
        "300: a whole minute, default); embeddings also: tokens 150000/min (burst 40000), "
        "concurrency 4"
    ]
    assert limit_warnings(source) == []


def test_policy_check_warns_of_a_class_limit_that_never_binds() -> None:
    text = EXAMPLE.replace("{requests_per_minute: 300}", "{requests_per_minute: 900}")
    text = text.replace("max_concurrency: 4}", "max_concurrency: 40}")
    warnings = [str(w) for w in limit_warnings(policy_from_text(_text(text)).source)]
    assert warnings == [
        "tenants.a.limits.per_endpoint.chat.requests_per_minute: warning: 900 is above the "
        "tenant-wide 600, which every chat request also takes from: it never binds",
        "tenants.a.limits.per_endpoint.embeddings.max_concurrency: warning: 40 is above the "
        "tenant-wide 32, which every embeddings request also takes from: it never binds",
    ]


def test_cli_check_prints_the_class_limits(tmp_path: Path) -> None:
    file = tmp_path / "p.yaml"
    file.write_text(_text(EXAMPLE.replace("requests_per_minute: 300", "requests_per_minute: 900")))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "policy", "check", str(file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stdout.splitlines()[2].startswith("  tenant a: every request: requests 600")
    assert result.stderr.splitlines() == [
        f"{file}: tenants.a.limits.per_endpoint.chat.requests_per_minute: warning: 900 is "
        "above the tenant-wide 600, which every chat request also takes from: it never binds"
    ]
