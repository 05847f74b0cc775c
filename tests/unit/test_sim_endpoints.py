"""The simulator's endpoint column: traces name each request's endpoint class, and a pooling
request (embeddings, rerank) is replayed as a prefill with no output, on a pool serving it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from extproc.types import Outcome
from gateway_lab.sim.trace import TraceError, TraceRequest, read_trace, write_trace
from tests.unit.sim_support import HAND, make_policy, req, run

MIXED = """time,input_tokens,output_tokens,tenant,endpoint
0.0,100,20,a,chat
0.5,300,,b,embeddings
1.0,50,7,a,
1.5,80,99,b,rerank
2.0,40,5,a,completions
"""


def test_the_endpoint_column_is_read_and_pooling_rows_have_no_output(tmp_path: Path) -> None:
    path = tmp_path / "mixed.csv"
    path.write_text(MIXED)
    trace = read_trace(path)
    assert [r.endpoint for r in trace] == ["chat", "embeddings", "chat", "rerank", "completions"]
    assert [r.output_tokens for r in trace] == [20, 0, 7, 0, 5]
    copy = tmp_path / "copy.jsonl"
    write_trace(copy, trace)
    assert read_trace(copy) == trace
    assert '"endpoint"' not in copy.read_text().splitlines()[0]  # chat is the default


def test_an_unknown_endpoint_class_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("time,input_tokens,output_tokens,endpoint\n0,10,1,chat\n1,10,1,images\n")
    with pytest.raises(TraceError, match=r"bad\.csv:3: unknown endpoint class 'images'"):
        read_trace(path)


def pooled(at: float, prompt: int, tenant: str = "a") -> TraceRequest:
    return replace(req(at, prompt, 0, tenant), endpoint="embeddings")


POOLS = {
    "gen": {"max_inflight": 8},
    "emb": {"max_inflight": 8, "serves": "[embeddings, rerank]"},
}


def test_pooling_requests_cost_their_prefill_only_on_the_pool_serving_them() -> None:
    result = run([req(0.0, 100, 10), pooled(0.0, 1000), pooled(0.0, 200)], make_policy(pools=POOLS))
    chat, big, small = result.records
    assert chat.pool == "gen" and big.pool == "emb" == small.pool
    assert all(r.outcome is Outcome.ADMITTED for r in result.records)
    assert big.generated == 0 and big.max_tokens == 0 and big.charged == 0
    # Answered whole: its "first token" is its answer, after its 1000-token prefill.
    assert big.first_token_at == big.finished_at
    prefill_s = HAND.step_base_s + HAND.step_per_prefill_token_s * 512  # chunked at 512
    assert big.e2e is not None and big.e2e >= HAND.frontend_s + 2 * prefill_s
    [emb] = [s for s in result.replicas if s.pool == "emb"]
    assert emb.output_tokens == 0  # no decode ran on the pooling engine


def test_a_pooling_request_no_pool_serves_is_refused_like_the_gateway_does() -> None:
    result = run([pooled(0.0, 100), req(0.0, 100, 5)])
    refused, chat = result.records
    assert (
        refused.outcome is Outcome.BAD_REQUEST and "no model serving embeddings" in refused.detail
    )
    assert chat.outcome is Outcome.ADMITTED
