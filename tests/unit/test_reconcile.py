"""The engine ledger: cut-short streams corrected from the engine's own counters."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.service.engine_metrics import EngineReading, parse_engine_metrics
from extproc.service.reconcile import CutShort, EngineLedger, _apportion

ENGINE = "127.0.0.1:8001"


def reading(prompt: float, generation: float, running: float = 0.0) -> EngineReading:
    return EngineReading(0.0, running, 0.0, prompt, generation)


def cut(tenant: str, input_tokens: int, output_tokens: int, at: float = 0.0) -> CutShort:
    return CutShort(f"r-{tenant}-{output_tokens}", tenant, "short", input_tokens, output_tokens, at)


def based_ledger() -> EngineLedger:
    ledger = EngineLedger(max_wait_s=30.0)
    ledger.track(ENGINE, "short")
    assert ledger.balance(ENGINE, reading(1000, 5000)) == []  # the base
    return ledger


def test_one_cut_short_request_gets_the_engines_exact_count() -> None:
    ledger = based_ledger()
    ledger.completed(ENGINE, "short", 40, 20)
    assert ledger.cut_short(ENGINE, cut("globex", 30, 7))  # estimate 30 in, 7 deltas seen
    assert ledger.wanted() == [(ENGINE, "short")]
    # The engine prefilled 40 + 33 prompt tokens and generated 20 + 9.
    [correction] = ledger.balance(ENGINE, reading(1073, 5029))
    assert (correction.input_tokens, correction.output_tokens) == (33, 9)
    assert ledger.pending() == 0 and ledger.corrected == 1
    # Rebased: the next window starts from this reading.
    ledger.cut_short(ENGINE, cut("globex", 10, 1))
    [again] = ledger.balance(ENGINE, reading(1085, 5031))
    assert (again.input_tokens, again.output_tokens) == (12, 2)


def test_residual_split_over_several_requests_adds_up_exactly() -> None:
    ledger = based_ledger()
    ledger.cut_short(ENGINE, cut("acme", 10, 3))
    ledger.cut_short(ENGINE, cut("globex", 30, 9))
    corrections = ledger.balance(ENGINE, reading(1000 + 40 + 5, 5000 + 12 + 4))
    assert sum(c.input_tokens for c in corrections) == 45
    assert sum(c.output_tokens for c in corrections) == 16
    by_tenant = {c.item.tenant: c for c in corrections}
    assert by_tenant["globex"].output_tokens > by_tenant["acme"].output_tokens


def test_no_base_means_the_provisional_charge_stands() -> None:
    ledger = EngineLedger()
    ledger.track(ENGINE, "short")
    assert not ledger.cut_short(ENGINE, cut("acme", 10, 3))
    assert ledger.pending() == 0


def test_tokens_nobody_here_routed_are_reported_not_charged() -> None:
    ledger = based_ledger()
    ledger.completed(ENGINE, "short", 10, 10)
    assert ledger.balance(ENGINE, reading(1015, 5012)) == []
    assert ledger.unattributed_tokens == 7


def test_a_correction_that_never_comes_is_given_up_and_the_base_dropped() -> None:
    ledger = based_ledger()
    ledger.cut_short(ENGINE, cut("acme", 10, 3, at=100.0))
    assert ledger.expire(now=120.0) == []
    [expired] = ledger.expire(now=131.0)
    assert expired.tenant == "acme" and ledger.given_up == 1
    assert ledger.engines[ENGINE].base_prompt is None
    assert ledger.wanted() == [(ENGINE, "short")]  # a new base at the next quiet moment


@given(
    st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=20),
    st.integers(min_value=-50_000, max_value=50_000),
)
def test_apportion_always_sums_to_the_total(weights: list[int], total: int) -> None:
    parts = _apportion(weights, total)
    assert sum(parts) == total and len(parts) == len(weights)


def test_engine_page_gives_the_token_counters() -> None:
    page = "\n".join(
        [
            'vllm:num_requests_running{model_name="m"} 0.0',
            'vllm:num_requests_waiting{model_name="m"} 0.0',
            'vllm:prompt_tokens_total{model_name="m"} 1234.0',
            'vllm:generation_tokens_total{model_name="m"} 567.0',
            'vllm:prompt_tokens_created{model_name="m"} 1.7e9',
        ]
    )
    parsed = parse_engine_metrics(page)
    assert parsed is not None and parsed.idle
    assert (parsed.prompt_tokens, parsed.generation_tokens) == (1234.0, 567.0)


def test_reconciliation_needs_to_be_the_engines_only_client() -> None:
    from extproc.policy import policy_from_text
    from extproc.service.composition import compose
    from tests.conftest import policy_yaml

    policy = policy_from_text(policy_yaml("127.0.0.1:8001", "127.0.0.1:8002"), "policy.yaml")
    alone = compose(policy)
    assert alone.ledger is not None
    assert set(alone.ledger.engines) == {"127.0.0.1:8001", "127.0.0.1:8002"}
    assert alone.state_view()["reconciliation"]["enabled"] is True
    # One of several worker processes: other processes' tokens would land in its books.
    shared = compose(policy, sole_client=False)
    assert shared.ledger is None
    assert shared.state_view()["reconciliation"] == {"enabled": False}
