"""vLLM V1's scheduling policies and long_prefill_token_threshold in the scheduler core."""

from __future__ import annotations

import pytest

from gateway_lab.engine.model import EngineCore, FinishedRequest, StepResult
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.engine.waiting import WaitingQueue

BASE = EngineProfile(
    name="sched",
    step_base_s=0.01,
    step_per_decode_s=0.001,
    step_per_prefill_token_s=0.0001,
    step_per_context_token_s=0.0,
    max_num_seqs=1,
    max_num_batched_tokens=512,
    kv_blocks=1024,
    block_size=16,
    max_model_len=4096,
)


def run(core: EngineCore, now: float = 0.0) -> tuple[list[StepResult], dict[str, FinishedRequest]]:
    steps: list[StepResult] = []
    while core.has_work:
        result = core.step(now)
        steps.append(result)
        now = result.end
        assert len(steps) < 10_000
    return steps, {f.req_id: f for s in steps for f in s.finished}


def long_prompts_then_short(policy: str) -> dict[str, FinishedRequest]:
    """Three long low-priority prompts (one running, two waiting), then a short urgent one."""
    core = EngineCore(BASE.with_overrides({"scheduling_policy": policy}))
    core.add_request("long0", 400, 20, arrival_time=0.0, priority=1)
    first = core.step(0.0)
    assert first.first_token == ("long0",)
    core.add_request("long1", 400, 20, arrival_time=0.001, priority=1)
    core.add_request("long2", 400, 20, arrival_time=0.002, priority=1)
    core.add_request("short", 10, 1, arrival_time=0.003, priority=0)
    return run(core, first.end)[1]


def test_priority_lets_a_short_request_jump_the_waiting_queue_not_the_running_batch() -> None:
    done = long_prompts_then_short("priority")
    # The running long request is never displaced: the short one starts when it finishes...
    assert done["short"].scheduled_time == pytest.approx(done["long0"].finish_time)
    # ...and ahead of the long prompts that were waiting before it arrived.
    assert done["short"].finish_time <= done["long1"].scheduled_time
    assert done["long1"].scheduled_time < done["long2"].scheduled_time
    assert all(f.preemptions == 0 for f in done.values())


def test_fcfs_ignores_priority() -> None:
    done = long_prompts_then_short("fcfs")
    order = sorted(done.values(), key=lambda f: f.scheduled_time)
    assert [f.req_id for f in order] == ["long0", "long1", "long2", "short"]
    short_ttft = done["short"].first_token_time - done["short"].arrival_time
    prio = long_prompts_then_short("priority")
    assert short_ttft > 2 * (prio["short"].first_token_time - prio["short"].arrival_time)


def test_equal_priorities_are_served_in_arrival_order() -> None:
    core = EngineCore(BASE.with_overrides({"scheduling_policy": "priority"}))
    for index, arrival in enumerate((0.0, 0.5, 0.5, 0.2)):
        core.add_request(f"r{index}", 10, 1, arrival_time=arrival, priority=3)
    _, done = run(core)
    order = sorted(done.values(), key=lambda f: f.scheduled_time)
    assert [f.req_id for f in order] == ["r0", "r3", "r1", "r2"]


def kv_pressure(policy: str) -> tuple[list[StepResult], dict[str, FinishedRequest]]:
    # 4 blocks of 4 tokens: "old-low" grows to 5 + 7 = 12 tokens (3 blocks), "new-high" to
    # 8 + 7 = 15 (4 blocks): both cannot fit. "new-high" is the first to need a block no one has,
    # in a step where "old-low" (ahead of it in the running batch) was already scheduled.
    profile = BASE.with_overrides(
        {
            "scheduling_policy": policy,
            "max_num_seqs": 8,
            "kv_blocks": 4,
            "block_size": 4,
            "max_model_len": 16,
        }
    )
    core = EngineCore(profile)
    core.add_request("old-low", 5, 8, arrival_time=0.0, priority=5)
    first = core.step(0.0)
    core.add_request("new-high", 8, 8, arrival_time=first.end, priority=0)
    steps, done = run(core, first.end)
    return [first, *steps], done


def test_fcfs_preempts_the_latest_arrival_under_kv_pressure() -> None:
    steps, done = kv_pressure("fcfs")
    assert {rid for s in steps for rid in s.preempted} == {"new-high"}
    step = next(s for s in steps if s.preempted)
    assert "old-low" in step.output and "new-high" not in step.output
    assert done["old-low"].preemptions == 0 and done["new-high"].preemptions >= 1


def test_priority_preempts_the_lowest_priority_request_even_if_older() -> None:
    steps, done = kv_pressure("priority")
    assert {rid for s in steps for rid in s.preempted} == {"old-low"}
    assert steps[2].preempted == ("old-low",)
    assert done["new-high"].preemptions == 0 and done["old-low"].preemptions >= 1
    # The victim was scheduled earlier in the same step: its tokens are taken back out.
    step = next(s for s in steps if s.preempted)
    assert "old-low" not in step.output and "new-high" in step.output
    assert step.num_decodes == 1
    assert done["new-high"].finish_time < done["old-low"].finish_time
    assert all(f.output_tokens == 8 for f in done.values())


def short_beside_long(threshold: int) -> tuple[list[StepResult], dict[str, FinishedRequest]]:
    profile = BASE.with_overrides({"max_num_seqs": 8, "long_prefill_token_threshold": threshold})
    core = EngineCore(profile)
    core.add_request("chat", 10, 40, arrival_time=0.0)
    core.add_request("long", 2000, 1, arrival_time=0.0)
    core.add_request("quiet", 10, 1, arrival_time=0.0)
    return run(core)


def test_threshold_caps_one_prompt_per_step_and_lets_others_run() -> None:
    steps, done = short_beside_long(128)
    long_steps = [s for s in steps if s.start < done["long"].first_token_time]
    # Every step computes at most 128 of the long prompt (+ the small prompts / decodes).
    assert max(s.num_prefill_tokens for s in long_steps) <= 128 + 10 + 10
    assert len(long_steps) >= 2000 // 128
    # The quiet request is admitted in the first step beside the long prompt's first chunk...
    assert done["quiet"].first_token_time == pytest.approx(steps[0].end)
    # ...and the chat request decodes in every step while the long prompt is prefilled.
    assert all("chat" in s.output for s in long_steps)


def test_without_threshold_a_long_prompt_takes_the_step_budget() -> None:
    steps, done = short_beside_long(0)
    assert steps[0].num_prefill_tokens == 512
    assert done["quiet"].first_token_time > steps[0].end
    capped = short_beside_long(128)[1]
    assert done["quiet"].first_token_time > 2 * capped["quiet"].first_token_time
    # The chat request's gaps between tokens are longer while whole-budget chunks run.
    gaps = [s.duration for s in steps if "chat" in s.output]
    capped_gaps = [s.duration for s in short_beside_long(128)[0] if "chat" in s.output]
    assert max(gaps) > 2 * max(capped_gaps)


def test_profile_rejects_unknown_policy_and_negative_threshold() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        BASE.with_overrides({"scheduling_policy": "lifo"})
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        BASE.with_overrides({"long_prefill_token_threshold": -1})
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        WaitingQueue("lifo")


def test_abort_in_a_priority_queue_is_skipped() -> None:
    core = EngineCore(BASE.with_overrides({"scheduling_policy": "priority"}))
    core.add_request("run", 10, 5)
    core.step(0.0)
    core.add_request("gone", 10, 1, priority=0)
    core.add_request("kept", 10, 1, priority=1)
    assert core.num_waiting == 2
    assert core.abort("gone") is True
    assert core.num_waiting == 1
    _, done = run(core, 1.0)
    assert set(done) == {"run", "kept"}


def test_a_request_that_preempts_itself_does_not_leave_an_empty_step() -> None:
    # Under "priority" the victim can be the request being scheduled, ahead of the others in
    # the running batch: vLLM's next scheduling pass runs them, so the step is not idle.
    profile = BASE.with_overrides(
        {
            "scheduling_policy": "priority",
            "max_num_seqs": 8,
            "kv_blocks": 6,
            "block_size": 4,
            "max_model_len": 24,
        }
    )
    core = EngineCore(profile)
    core.add_request("low", 8, 8, arrival_time=0.0, priority=5)
    now = core.step(0.0).end
    core.add_request("high", 8, 8, arrival_time=now, priority=0)
    while core.has_work:
        result = core.step(now)
        assert not result.idle
        if result.preempted:
            assert result.preempted == ("low",) and result.output == ("high",)
        now = result.end


def test_threshold_is_not_applied_to_a_lone_request() -> None:
    # vLLM: with nobody to starve, a long prefill uses the whole budget.
    core = EngineCore(BASE.with_overrides({"max_num_seqs": 8, "long_prefill_token_threshold": 64}))
    core.add_request("alone", 1000, 1)
    assert core.step(0.0).num_prefill_tokens == 512


def test_a_threshold_that_admits_every_long_prompt_leaves_priority_nothing_to_reorder() -> None:
    # 8 long prompts x 256-token chunks fill the 2,048-token budget in one step: all 8 run, no
    # queue forms, and the urgent short request waits for their prefills like everyone else.
    def quiet_ttft(threshold: int) -> float:
        profile = BASE.with_overrides(
            {
                "scheduling_policy": "priority",
                "max_num_seqs": 32,
                "max_num_batched_tokens": 2048,
                "long_prefill_token_threshold": threshold,
            }
        )
        core = EngineCore(profile)
        for index in range(8):
            core.add_request(f"long{index}", 1800, 4, arrival_time=0.0, priority=1)
        first = core.step(0.0)
        core.add_request("quiet", 50, 1, arrival_time=first.start, priority=0)
        done = run(core, first.end)[1]
        return done["quiet"].first_token_time - done["quiet"].arrival_time

    assert quiet_ttft(256) > 3 * quiet_ttft(0)
