"""The locality benchmark's service gap: only over intervals where both tenants wait."""

from __future__ import annotations

from gateway_lab.bench.locality import backlogged_gap, chat_spec
from gateway_lab.bench.records import Record


def _admitted(tenant: str, start: float, queued_s: float, prompt: int) -> Record:
    return Record(tenant, start, 200, 0.1, start + 1, prompt, 8, queued_s * 1000.0, 8)


def test_the_gap_counts_only_while_both_tenants_wait() -> None:
    records = [
        _admitted("chat", 0.0, 2.0, 100),  # chat waits 0-2, admitted at 2
        _admitted("docs", 0.5, 1.0, 50),  # docs waits 0.5-1.5, admitted at 1.5
        _admitted("chat", 5.0, 0.0, 900),  # admitted at once, nobody waits
        _admitted("chat", 6.0, 0.0, 900),
    ]
    gap = backlogged_gap(records, ("chat", "docs"), 0.0, 10.0)
    assert gap["both_backlogged_s"] == 1.0
    assert gap["max_gap"] == 50 + 2 * 8  # docs' one dispatch inside [0.5, 1.5]
    # any interval: from after docs' dispatch (-66) to after chat's last (+1882)
    assert gap["max_gap_any_interval"] == 66 + (116 - 66) + 2 * 916


def test_a_conversation_turn_counts_its_whole_history() -> None:
    spec = chat_spec("chat", [("system", "abcd" * 10), ("user", "wxyz")], 8)
    assert spec.prompt_tokens == (4 + 10) + (4 + 1)
    assert b'"role":"system"' in spec.body()
