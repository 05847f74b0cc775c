"""The simulator's engines schedule by vLLM's request priority read from a trace."""

from __future__ import annotations

from pathlib import Path

from sim_support import HAND, make_policy, run

from gateway_lab.sim.trace import TraceRequest, read_trace, write_trace

ONE_SLOT = HAND.with_overrides({"max_num_seqs": 1})
# The gateway's own engine priority off: the trace's priority is what the engine gets.
TRACE_PRIORITY = make_policy(pools={"p": {"max_inflight": 64, "engine_priority": "false"}})


def long_prompts_then_quiet() -> list[TraceRequest]:
    longs = [TraceRequest(0.001 * i, 400, 20, "a", priority=1) for i in range(3)]
    return [*longs, TraceRequest(0.01, 10, 1, "a", priority=0)]


def ttft_of_quiet(policy: str) -> float:
    result = run(
        long_prompts_then_quiet(),
        TRACE_PRIORITY,
        profile=ONE_SLOT.with_overrides({"scheduling_policy": policy}),
    )
    records = {r.request_id: r for r in result.records}
    quiet = records["r3"]
    assert quiet.ttft is not None
    starts = sorted(records.values(), key=lambda r: r.first_token_at or 0.0)
    if policy == "priority":
        assert [r.request_id for r in starts] == ["r0", "r3", "r1", "r2"]
    else:
        assert [r.request_id for r in starts] == ["r0", "r1", "r2", "r3"]
    return quiet.ttft


def test_trace_priority_reaches_the_engine_under_the_priority_policy() -> None:
    assert ttft_of_quiet("fcfs") > 2 * ttft_of_quiet("priority")


def test_priority_round_trips_through_a_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    write_trace(path, long_prompts_then_quiet())
    assert [r.priority for r in read_trace(path)] == [1, 1, 1, 0]
    plain = tmp_path / "plain.csv"
    plain.write_text("time,input_tokens,output_tokens\n0,5,5\n")
    assert read_trace(plain)[0].priority == 0
