"""The pool keys that reach into the engines (engine_priority, prefill_budget_tokens): their
defaults, strict validation with file:line, and what `extproc policy check` says."""

from __future__ import annotations

import pytest

from extproc.policy import PolicyError, policy_from_text
from extproc.policy.capacity import describe_isolation


def _text(keys: str = "", tier_options: str = "") -> str:
    extra = f",\n       {keys}" if keys else ""
    return f"""\
version: 1
tiers: [premium, standard]
{tier_options}tenants:
  quiet: {{tier: standard}}
pools:
  p: {{max_total_tokens: 8192, max_inflight: 24, max_inflight_tokens: 10000000,
       endpoints: ["127.0.0.1:1"]{extra}}}
"""


def test_defaults_priority_on_and_pacing_off() -> None:
    pool = policy_from_text(_text()).pools["p"]
    assert pool.engine_priority is True
    assert pool.prefill_budget_tokens is None and pool.effective_prefill_budget == 0


@pytest.mark.parametrize(
    ("keys", "budget"),
    [("prefill_budget_tokens: 0", 0), ("prefill_budget_tokens: false", 0),
     ("prefill_budget_tokens: 3000", 3000)],
)  # fmt: skip
def test_each_budget_keeps_its_meaning(keys: str, budget: int) -> None:
    assert policy_from_text(_text(keys)).pools["p"].effective_prefill_budget == budget


@pytest.mark.parametrize(
    ("keys", "field"),
    [
        ("engine_priority: 1", "pools.p.engine_priority"),
        ("engine_priority: on", "pools.p.engine_priority"),
        ("prefill_budget_tokens: -1", "pools.p.prefill_budget_tokens"),
        ("prefill_budget_tokens: true", "pools.p.prefill_budget_tokens"),
        ("prefill_budget_tokens: 1k", "pools.p.prefill_budget_tokens"),
        ("prefill_budget: 100", "pools.p.prefill_budget"),
    ],
)
def test_isolation_keys_are_strict_with_file_line(keys: str, field: str) -> None:
    with pytest.raises(PolicyError) as caught:
        policy_from_text(_text(keys), "p.yaml")
    issues = [str(issue) for issue in caught.value.issues]
    assert any(issue.startswith(f"p.yaml:8: {field}") for issue in issues), issues


def test_policy_check_explains_the_isolation_settings() -> None:
    assert describe_isolation(policy_from_text(_text()).source) == [
        "pool p: engine priority on (body `priority` = tier rank x 2, + 1 when backlogged; "
        "engines need --scheduling-policy priority), prefill pacing off (default)"
    ]
    paced = "prefill_budget_tokens: 8192"
    assert describe_isolation(policy_from_text(_text(paced)).source)[0].endswith(
        "prefill budget 8192 prompt tokens for backlogged tenants"
    )
    options = "tier_options: {standard: {latency_delta: 150ms}}\n"
    keys = "engine_priority: false, prefill_budget_tokens: 0"
    assert describe_isolation(policy_from_text(_text(keys, options)).source) == [
        "pool p: engine priority off, prefill pacing off (set)",
        "tier standard: latency_delta first_token 150 ms, every_token 150 ms: a light "
        "tenant's lag behind alone steers the backlogged tenants' share of its pools",
    ]
    options = "tier_options: {standard: {latency_delta: {token_gap: 20ms}}}\n"
    assert describe_isolation(policy_from_text(_text(keys, options)).source)[1].startswith(
        "tier standard: latency_delta token_gap 20 ms: a light tenant's lag"
    )
    options = "tier_options: {standard: {latency_delta: {token_gap: 20ms, quantile: 0.99}}}\n"
    assert describe_isolation(policy_from_text(_text(keys, options)).source)[1].startswith(
        "tier standard: latency_delta token_gap 20 ms at P99: a light tenant's lag"
    )
    options = "tier_options: {standard: {latency_delta: {first_token: 1.8x, token_gap: 5ms}}}\n"
    assert describe_isolation(policy_from_text(_text(keys, options)).source)[1].startswith(
        "tier standard: latency_delta first_token 1.8x alone, token_gap 5 ms: a light tenant's"
    )
