"""The vllm-priority benchmark's arms and policies (no engine): the δ arms' objectives reach
the policy the gateway loads."""

from __future__ import annotations

from extproc.policy import policy_from_text
from extproc.policy.model import AloneMultiple
from gateway_lab.bench.vllm_priority import ARMS, POOL, Workload, delta_arms, policy_text


def test_a_delta_arm_is_priority_adaptive_with_its_first_token_objective() -> None:
    relative, absolute = delta_arms(["2x", "30ms"])
    assert (relative.name, relative.engine_policy, relative.flood, relative.static) == (
        "priority-first-2x", "priority", True, False,
    )  # fmt: skip
    assert absolute.name == "priority-first-30ms"
    assert {arm.name for arm in ARMS}.isdisjoint({relative.name, absolute.name})
    for arm, expected in ((relative, AloneMultiple(2.0)), (absolute, 0.03)):
        text = policy_text("127.0.0.1:1", Workload(), arm.static, arm.latency_delta)
        source = policy_from_text(text, "bench.yaml").source
        delta = source.tier_options["standard"].latency_delta
        assert delta is not None and delta.first_token == expected
        assert delta.every_token is None
        assert source.pools[POOL].adaptive_enabled


def test_the_arms_without_an_objective_set_none() -> None:
    for arm in ARMS:
        source = policy_from_text(policy_text("127.0.0.1:1", Workload(), arm.static)).source
        assert source.tier_options == {}
