"""The locality benchmark's service gap, from the gateway's sampled accounting: only over
runs of samples where both tenants are backlogged."""

from __future__ import annotations

from gateway_lab.bench.locality import POOL, backlogged_gap, chat_spec, sample_of


def _sample(at: float, chat: int, docs: int, waiting: tuple[bool, bool]) -> object:
    tenants = {
        "chat": {"served_tokens": chat, "served_requests": 0,
                 "backlogged_pools": [POOL] if waiting[0] else []},
        "docs": {"served_tokens": docs, "served_requests": 0,
                 "backlogged_pools": [POOL] if waiting[1] else []},
    }  # fmt: skip
    return sample_of(at, tenants, output=8)


def test_the_gap_counts_only_while_both_tenants_are_backlogged() -> None:
    samples = [
        _sample(0.0, 0, 0, (True, True)),
        _sample(0.1, 500, 0, (True, True)),
        _sample(0.2, 500, 900, (True, True)),  # run 1: diff 0, 500, -400 -> 900
        _sample(0.3, 5000, 900, (True, False)),  # docs idle: chat may run ahead
        _sample(0.4, 5000, 1000, (True, True)),
        _sample(0.5, 5100, 1000, (True, True)),  # run 2: diff 4000, 4100 -> 100
    ]
    gap = backlogged_gap(samples, 0.0, 1.0)  # type: ignore[arg-type]
    assert gap["max_gap"] == 900
    assert gap["max_gap_any_interval"] == 4100 - (-400)
    assert abs(gap["both_backlogged_s"] - 0.3) < 1e-9


def test_cost_adds_the_second_output_weight_per_request() -> None:
    tenants = {"chat": {"served_tokens": 100, "served_requests": 2, "backlogged_pools": []}}
    sample = sample_of(1.0, tenants, output=8)
    assert sample.cost["chat"] == 100 + 2 * 8
    assert sample.cost["docs"] == 0 and sample.backlogged == {"chat": False, "docs": False}


def test_a_conversation_turn_counts_its_whole_history() -> None:
    spec = chat_spec("chat", [("system", "abcd" * 10), ("user", "wxyz")], 8)
    assert spec.prompt_tokens == (4 + 10) + (4 + 1)
    assert b'"role":"system"' in spec.body()
