from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc.policy import PolicyError, hash_key, load_policy, policy_from_text
from extproc.policy.yaml_limits import MAX_POLICY_BYTES
from tests.adversarial.yaml_bombs import BILLION_LAUGHS
from tests.conftest import TEST_KEYS, policy_yaml

REPO = Path(__file__).resolve().parents[2]


def issues_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_valid_policy_compiles() -> None:
    policy = policy_from_text(policy_yaml())
    assert policy.tier_rank == {"premium": 0, "standard": 1, "batch": 2}
    assert [name for name, _ in policy.pools_by_size] == ["short", "long"]
    assert policy.keys.tenant_for(TEST_KEYS["globex"]) == "globex"
    assert policy.keys.tenant_for("nope") is None
    assert policy.tenants["acme"].limits.max_queue_wait == 30.0


def test_shipped_policies_are_valid() -> None:
    for file in sorted((REPO / "policies").glob("*.yaml")):
        load_policy(file)


def test_unknown_key_names_file_line_and_field() -> None:
    text = policy_yaml().replace(
        "    tier: standard\n    weight: 1.0\n", "    tier: standard\n    colour: red\n", 1
    )
    found = issues_of(text)
    assert found == [f"p.yaml:{line_of(text, 'colour')}: tenants.globex.colour: unknown key"]


def test_wrong_type() -> None:
    text = policy_yaml(short_inflight='"many"')  # type: ignore[arg-type]
    [issue] = issues_of(text)
    assert issue.startswith(f"p.yaml:{line_of(text, 'many')}: pools.short.max_inflight:")
    assert "integer" in issue


def test_bad_duration() -> None:
    text = policy_yaml(acme_limits="{max_queue_wait: soon}")
    [issue] = issues_of(text)
    assert f"p.yaml:{line_of(text, 'soon')}: tenants.acme.limits.max_queue_wait" in issue
    assert "invalid duration 'soon'" in issue


@pytest.mark.parametrize(
    ("raw", "seconds"), [("500ms", 0.5), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), (5, 5.0)]
)
def test_durations(raw: object, seconds: float) -> None:
    policy = policy_from_text(policy_yaml(acme_limits=f"{{max_queue_wait: {raw}}}"))
    assert policy.tenants["acme"].limits.max_queue_wait == seconds


def test_unknown_tier() -> None:
    text = policy_yaml().replace("tier: premium", "tier: gold")
    assert issues_of(text) == [
        f"p.yaml:{line_of(text, 'gold')}: tenants.acme.tier: unknown tier 'gold'; "
        "tiers are ['premium', 'standard', 'batch']"
    ]


def test_key_hash_used_by_two_tenants() -> None:
    text = policy_yaml().replace(hash_key(TEST_KEYS["initech"]), hash_key(TEST_KEYS["globex"]))
    [issue] = issues_of(text)
    globex_hash = hash_key(TEST_KEYS["globex"])
    line = [i for i, row in enumerate(text.splitlines(), 1) if globex_hash in row][1]
    assert (
        issue
        == f"p.yaml:{line}: tenants.initech.api_keys.0: key hash already used by tenant 'globex'"
    )


def test_plain_key_is_refused() -> None:
    text = policy_yaml().replace(hash_key(TEST_KEYS["acme"]), "my-plain-key")
    [issue] = issues_of(text)
    assert "tenants.acme.api_keys.0" in issue and "sha256" in issue


def test_empty_endpoint_list() -> None:
    text = policy_yaml().replace('endpoints: ["127.0.0.1:8002"]', "endpoints: []")
    [issue] = issues_of(text)
    assert issue.startswith(f"p.yaml:{line_of(text, 'endpoints: []')}: pools.long.endpoints:")


def test_empty_pools() -> None:
    text = policy_yaml().split("pools:")[0] + "pools: {}\n"
    [issue] = issues_of(text)
    assert "pools" in issue


def test_missing_field_and_yaml_syntax() -> None:
    assert issues_of("version: 1\ntiers: [a]\npools: {}\n")[0].startswith(
        "p.yaml:1: tenants: required"
    )
    [issue] = issues_of("version: 1\ntiers: [a\n")
    assert issue.startswith("p.yaml:") and "YAML syntax" in issue


def test_priority_clamp() -> None:
    text = policy_yaml(extra="priority: {default: 2, min: 0, max: 5}\n").replace(
        "    tier: premium\n", "    tier: premium\n    max_priority: 3\n"
    )
    policy = policy_from_text(text)
    acme, globex = policy.tenants["acme"], policy.tenants["globex"]
    assert policy.clamp_priority(acme, None) == 2
    assert policy.clamp_priority(acme, 9) == 3
    assert policy.clamp_priority(globex, 9) == 5
    assert policy.clamp_priority(globex, -4) == 0


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", *args], input=stdin, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_cli_check(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(policy_yaml())
    assert run_cli("policy", "check", str(good)).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(policy_yaml().replace("tier: premium", "tier: gold"))
    result = run_cli("policy", "check", str(bad))
    assert result.returncode == 1
    assert f"{bad}:{line_of(bad.read_text(), 'gold')}: tenants.acme.tier" in result.stderr


def test_cli_hash_key_and_schema() -> None:
    result = run_cli("policy", "hash-key", stdin="secret\n")
    assert result.returncode == 0 and result.stdout.strip() == hash_key("secret")
    schema = json.loads(run_cli("policy", "schema").stdout)
    assert schema["additionalProperties"] is False
    assert {"tiers", "tenants", "pools"} <= set(schema["required"])


def test_alias_bomb_is_refused_fast_with_its_line() -> None:
    """A 254-byte file of nested aliases took 19 s (and GBs) to reject before the bounds."""
    started = time.monotonic()
    issues = issues_of(BILLION_LAUGHS)
    assert time.monotonic() - started < 2.0
    assert issues == ["p.yaml:6: expands to more than 250000 nodes (aliases nest too deep)"]


def test_recursive_alias_and_deep_nesting_are_refused() -> None:
    assert issues_of("a: &a [1, *a]\n") == ["p.yaml:1: alias *a refers to itself"]
    deep = "a: " + "[" * 100 + "]" * 100 + "\n"
    assert issues_of(deep) == ["p.yaml:1: nested deeper than 64 levels"]


def test_oversized_policy_file_is_refused() -> None:
    text = policy_yaml() + "# " + "x" * MAX_POLICY_BYTES + "\n"
    assert issues_of(text) == [f"p.yaml:1: the policy file is larger than {MAX_POLICY_BYTES} bytes"]


def test_ordinary_aliases_still_work() -> None:
    text = policy_yaml(
        acme_limits="&shared {requests_per_minute: 60, max_queue_wait: 45s}",
        globex_limits="*shared",
    )
    policy = policy_from_text(text)
    assert policy.tenants["globex"].limits.max_queue_wait == 45.0


def test_hold_above_explicit_max_message_timeout_is_refused() -> None:
    text = policy_yaml(
        acme_limits="{max_queue_wait: 2m}", extra="gateway: {max_message_timeout: 60s}"
    )
    assert issues_of(text) == [
        f"p.yaml:{line_of(text, 'max_queue_wait: 2m')}: tenants.acme.limits.max_queue_wait: "
        "a hold of 125s (max_queue_wait + 5s) exceeds gateway.max_message_timeout 60s"
    ]
    fits = policy_yaml(extra="gateway: {max_message_timeout: 60s}")
    assert policy_from_text(fits).source.gateway.max_message_timeout == 60.0
