"""The pure scheduler core: timing, chunked prefill, limits, preemption, aborts, determinism."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_lab.engine.model import EngineCore, StepResult
from gateway_lab.engine.profiles import EngineProfile

ROUND = EngineProfile(
    name="round",
    step_base_s=0.01,
    step_per_decode_s=0.001,
    step_per_prefill_token_s=0.0001,
    step_per_context_token_s=0.00001,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    kv_blocks=1024,
    block_size=16,
    max_model_len=4096,
)


def small(**changes: int) -> EngineProfile:
    return ROUND.with_overrides({"kv_blocks": 64, "block_size": 4, "max_model_len": 64, **changes})


def run_to_completion(core: EngineCore, now: float = 0.0, limit: int = 100_000) -> list[StepResult]:
    steps: list[StepResult] = []
    while core.has_work:
        result = core.step(now)
        assert not result.idle
        steps.append(result)
        now = result.end
        assert len(steps) < limit
    return steps


def test_single_request_timing_matches_the_profile() -> None:
    core = EngineCore(ROUND)
    core.add_request("a", prompt_tokens=100, max_tokens=3, arrival_time=0.0)

    first = core.step(0.0)
    assert first.duration == pytest.approx(0.01 + 0.0001 * 100 + 0.00001 * 100)
    assert first.first_token == ("a",) and first.output == ("a",)
    assert (first.num_decodes, first.num_prefill_tokens, first.num_context_tokens) == (0, 100, 100)

    second = core.step(first.end)
    assert second.duration == pytest.approx(0.01 + 0.001 + 0.00001 * 101)
    assert second.first_token == () and second.output == ("a",) and second.finished == ()

    third = core.step(second.end)
    assert third.duration == pytest.approx(0.01 + 0.001 + 0.00001 * 102)
    (done,) = third.finished
    assert done.req_id == "a" and done.output_tokens == 3 and done.prompt_tokens == 100
    assert done.first_token_time == pytest.approx(first.end)
    assert done.finish_time == pytest.approx(third.end)
    assert done.scheduled_time == 0.0 and done.preemptions == 0
    assert not core.has_work and core.used_blocks == 0
    assert core.prompt_tokens_total == 100 and core.generation_tokens_total == 3
    assert core.step(third.end).idle


def test_chunked_prefill_splits_a_long_prompt() -> None:
    core = EngineCore(ROUND.with_overrides({"max_num_batched_tokens": 64}))
    core.add_request("long", prompt_tokens=150, max_tokens=2)
    chunks = []
    now = 0.0
    while True:
        result = core.step(now)
        now = result.end
        chunks.append(result.num_prefill_tokens)
        if result.first_token:
            break
    assert chunks == [64, 64, 22]
    # The whole prompt's blocks were reserved at admission.
    assert core.used_blocks == math.ceil(150 / 16)


def test_decodes_share_the_token_budget_with_a_prefill_chunk() -> None:
    core = EngineCore(ROUND.with_overrides({"max_num_batched_tokens": 64}))
    core.add_request("short", prompt_tokens=10, max_tokens=50)
    core.step(0.0)
    core.add_request("long", prompt_tokens=500, max_tokens=1)
    result = core.step(1.0)
    assert result.num_decodes == 1 and result.num_prefill_tokens == 63
    # The decode waits for the whole step, prefill chunk included (the noisy neighbour).
    assert result.duration == pytest.approx(
        ROUND.step_time(decodes=1, prefill_tokens=63, context_tokens=11 + 63)
    )


def test_max_num_seqs_is_respected() -> None:
    core = EngineCore(ROUND.with_overrides({"max_num_seqs": 2}))
    for i in range(5):
        core.add_request(f"r{i}", prompt_tokens=10, max_tokens=4)
    result = core.step(0.0)
    assert set(result.first_token) == {"r0", "r1"}
    assert core.num_running == 2 and core.num_waiting == 3
    now = result.end
    while core.has_work:
        result = core.step(now)
        now = result.end
        assert core.num_running <= 2
    assert core.generation_tokens_total == 20


def test_waiting_requests_are_admitted_fcfs() -> None:
    core = EngineCore(ROUND.with_overrides({"max_num_seqs": 1}))
    for i in range(3):
        core.add_request(f"r{i}", prompt_tokens=5, max_tokens=1)
    order = [f.req_id for step in run_to_completion(core) for f in step.finished]
    assert order == ["r0", "r1", "r2"]


def test_preemption_when_blocks_run_out_is_counted_and_recovers() -> None:
    # 6 blocks of 4 tokens; each request grows to 8 + 7 = 15 tokens (4 blocks): both cannot fit.
    core = EngineCore(small(kv_blocks=6, max_model_len=24))
    core.add_request("old", prompt_tokens=8, max_tokens=8)
    core.add_request("new", prompt_tokens=8, max_tokens=8)
    steps = run_to_completion(core)
    preempted = [rid for step in steps for rid in step.preempted]
    assert preempted and set(preempted) == {"new"}
    assert core.preemptions_total == len(preempted)
    finished = {f.req_id: f for step in steps for f in step.finished}
    assert finished["old"].preemptions == 0 and finished["new"].preemptions == len(preempted)
    assert all(f.output_tokens == 8 for f in finished.values())
    assert core.used_blocks == 0
    # A resumed request recomputes prompt + generated tokens as prefill, then continues.
    assert core.generation_tokens_total == 16 and core.prompt_tokens_total == 16
    assert sum(s.num_prefill_tokens for s in steps) > 16


def test_no_admission_in_a_step_that_preempted() -> None:
    core = EngineCore(small(kv_blocks=6, max_model_len=24))
    core.add_request("old", prompt_tokens=8, max_tokens=8)
    core.add_request("new", prompt_tokens=8, max_tokens=8)
    now = 0.0
    while True:
        result = core.step(now)
        now = result.end
        if result.preempted:
            assert result.first_token == ()
            assert core.num_waiting == 1
            break


def test_abort_frees_blocks_and_slots() -> None:
    core = EngineCore(ROUND.with_overrides({"max_num_seqs": 1}))
    core.add_request("run", prompt_tokens=40, max_tokens=100)
    core.add_request("wait", prompt_tokens=40, max_tokens=100)
    core.add_request("next", prompt_tokens=40, max_tokens=1)
    core.step(0.0)
    assert core.used_blocks == math.ceil(40 / 16) and core.num_waiting == 2

    assert core.abort("wait") is True
    assert core.num_waiting == 1
    assert core.abort("run") is True
    assert core.used_blocks == 0 and core.num_running == 0
    assert core.abort("run") is False and core.abort("nope") is False

    steps = run_to_completion(core, now=1.0)
    assert [f.req_id for s in steps for f in s.finished] == ["next"]
    assert core.used_blocks == 0 and not core.has_work


def test_add_request_rejects_bad_requests() -> None:
    core = EngineCore(small())
    core.add_request("a", prompt_tokens=10, max_tokens=10)
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request("a", prompt_tokens=10, max_tokens=10)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("b", prompt_tokens=60, max_tokens=10)
    with pytest.raises(ValueError):
        core.add_request("c", prompt_tokens=0, max_tokens=10)
    with pytest.raises(ValueError):
        core.add_request("d", prompt_tokens=5, max_tokens=0)


def _workload(core: EngineCore) -> list[tuple[object, ...]]:
    for i in range(30):
        core.add_request(f"r{i}", prompt_tokens=5 + (i * 7) % 40, max_tokens=1 + (i * 5) % 20)
    return [
        (s.duration, s.output, s.first_token, s.preempted, tuple(f.req_id for f in s.finished))
        for s in run_to_completion(core)
    ]


def test_deterministic() -> None:
    profile = small(kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=32)
    assert _workload(EngineCore(profile)) == _workload(EngineCore(profile))


requests = st.lists(
    st.tuples(
        st.integers(min_value=1, max_value=40),  # prompt tokens
        st.integers(min_value=1, max_value=24),  # max tokens
        st.integers(min_value=0, max_value=20),  # arrival step
        st.booleans(),  # abort it a few steps after arrival
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(
    reqs=requests,
    kv_blocks=st.integers(min_value=16, max_value=40),
    max_num_seqs=st.integers(min_value=1, max_value=8),
    budget=st.integers(min_value=1, max_value=48),
)
def test_all_requests_finish_and_blocks_return(
    reqs: list[tuple[int, int, int, bool]], kv_blocks: int, max_num_seqs: int, budget: int
) -> None:
    profile = small(kv_blocks=kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    core = EngineCore(profile)
    finished: dict[str, int] = {}
    aborted: set[str] = set()
    now = 0.0
    for step_no in range(20_000):
        for i, (prompt, max_tokens, arrival, abort) in enumerate(reqs):
            if arrival == step_no:
                core.add_request(f"r{i}", prompt, max_tokens, now)
            if abort and arrival + 3 == step_no and core.abort(f"r{i}"):
                aborted.add(f"r{i}")
        if step_no > 25 and not core.has_work:
            break
        result = core.step(now)
        now = result.end
        assert core.used_blocks <= kv_blocks
        assert core.num_running <= max_num_seqs
        assert result.num_decodes + result.num_prefill_tokens <= budget
        assert len(set(result.output)) == len(result.output)
        for f in result.finished:
            finished[f.req_id] = f.output_tokens
    else:
        pytest.fail("the engine did not drain")
    assert core.used_blocks == 0 and core.num_running == 0 and core.num_waiting == 0
    for i, (_, max_tokens, _, _) in enumerate(reqs):
        rid = f"r{i}"
        assert (rid in finished) != (rid in aborted)
        if rid in finished:
            assert finished[rid] == max_tokens
    if not aborted:
        assert core.generation_tokens_total == sum(r[1] for r in reqs)
