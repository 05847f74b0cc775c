"""The self-overload benchmark's pieces: Envoy's timed access log, the phase breakdown,
kvwarden's configuration, core pinning and the completion requests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from ruamel.yaml import YAML

from extproc.envoy_config import RenderOptions, render_bootstrap
from extproc.policy import policy_from_text
from extproc.policy.model import AloneMultiple, LatencyDelta
from gateway_lab.bench import phases
from gateway_lab.bench.cores import descendants, engines_apart, group_cpu, pin, split_cores
from gateway_lab.bench.kvwarden_front import Bucket, config_text
from gateway_lab.bench.records import Record
from gateway_lab.bench.self_overload import (
    ARMS,
    KVWARDEN_WORKLOAD_TARGET,
    compare,
    delta_arms,
    policy_text,
    summarize,
)
from gateway_lab.bench.self_overload_arms import (
    before_arms,
    door_arms,
    lua_arms,
    paced_arms,
    slice_arms,
)
from gateway_lab.bench.self_overload_load import CompletionSpec, Timing
from gateway_lab.bench.stack import cpu_seconds, with_cpu_slice
from gateway_lab.processes import envoy_binary


def rendered(filters: bool) -> str:
    policy = policy_from_text(policy_text("127.0.0.1:1"))
    return render_bootstrap(policy, RenderOptions(extproc_filters=filters, access_log=True))


@pytest.mark.parametrize("filters", [True, False])
def test_timed_bootstrap_adds_every_timing_field_and_envoy_accepts_it(
    filters: bool, tmp_path: Path
) -> None:
    text = phases.timed_bootstrap(rendered(filters))
    found = json.dumps(json.loads(text))
    for operator in (*phases.TIMING_FIELDS.values(), *phases.EXT_PROC_FIELDS.values()):
        assert operator in found
    config = tmp_path / "envoy.json"
    config.write_text(text)
    checked = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]


def test_a_bootstrap_without_access_log_is_refused() -> None:
    policy = policy_from_text(policy_text("127.0.0.1:1"))
    with pytest.raises(ValueError, match="no access log"):
        phases.timed_bootstrap(render_bootstrap(policy, RenderOptions(access_log=False)))


def test_breakdown_takes_medians_of_the_steps_of_answered_requests(tmp_path: Path) -> None:
    lines = ["[info] not an access log line"]
    for index in range(3):
        row = {
            "phase_log": "1", "status": 200, "tenant_header": "quiet",
            "request_in": 500, "upstream_start": 3500 + index * 1000,
            "upstream_headers": 20_000, "upstream_first_chunk": 37_000,
            "client_headers": 21_000, "ext_proc_request_header_latency_us": "1400",
        }  # fmt: skip
        lines.append(json.dumps(row))
    lines.append(json.dumps({"phase_log": "1", "status": 503, "request_in": 1}))
    lines.append(json.dumps({"phase_log": "1", "status": 200, "tenant_header": "flooder"}))
    log = tmp_path / "envoy.log"
    log.write_text("\n".join(lines) + "\n")
    result = phases.breakdown(phases.read_phase_log(log), "quiet")
    assert result["requests"] == 3
    steps = result["steps_ms"]
    assert steps["receive request"]["p50"] == 0.5
    assert steps["request -> upstream (ext_proc headers + body)"]["p50"] == 4.0
    assert steps["response headers -> client (ext_proc response headers)"]["p50"] == 1.0
    assert steps[phases.EXT_PROC_STEPS["ext_proc_request_header_latency_us"]]["p50"] == 1.4
    assert "  of which: Envoy waits for the request-body reply" not in steps


def test_kvwarden_config_fronts_the_engine_with_the_bucket() -> None:
    config = YAML(typ="safe").load(config_text(8123, "127.0.0.1:9001", "bench", Bucket(600, 10)))
    assert config["host"] == "127.0.0.1" and config["port"] == 8123
    assert config["models"] == [{"model_id": "bench", "engine": "vllm", "port": 9001}]
    assert config["tenant_defaults"] == {"rate_limit_rpm": 600, "rate_limit_burst": 10}


def test_completion_requests_ask_for_usage_only_when_told() -> None:
    plain = orjson.loads(CompletionSpec("quiet", "k", "hi.", 3, 64).body())
    assert plain["stream"] is True and plain["prompt"] == "hi." and plain["max_tokens"] == 64
    assert "stream_options" not in plain
    usage = orjson.loads(CompletionSpec("quiet", "k", "hi.", 3, 64, include_usage=True).body())
    assert usage["stream_options"] == {"include_usage": True}


def test_pin_keeps_this_process_on_its_allowed_cores() -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    assert pin(os.getpid(), allowed) >= 1
    assert os.sched_getaffinity(0) == allowed
    split = split_cores()
    if len(allowed) >= 2:
        assert split is not None and not split.engine & split.front
        assert split.engine | split.front == allowed
    else:
        assert split is None
    assert os.getpid() not in descendants(os.getpid())


def test_pinning_the_load_generator_leaves_its_engines_on_their_core() -> None:
    """The benchmarks start the engines as children of the load generator, pin them to a core
    of their own, then pin the load generator: without `keep` that moved the engines back to
    the front's core (every self-overload and low-load run before 2026-12-05)."""
    allowed = frozenset(os.sched_getaffinity(0))
    split = split_cores()
    if split is None:
        pytest.skip("one core: nothing to pin apart")
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert pin(engine.pid, split.engine) >= 1
        pin(os.getpid(), split.front, keep=[engine.pid])
        assert os.sched_getaffinity(engine.pid) == split.engine
        assert os.sched_getaffinity(0) == split.front
        pin(os.getpid(), split.front)  # no keep: the child follows
        assert os.sched_getaffinity(engine.pid) == split.front
        pin(os.getpid(), allowed)
        with engines_apart(split, [engine.pid]):
            assert os.sched_getaffinity(engine.pid) == split.engine
            assert os.sched_getaffinity(0) == split.front
        # A benchmark run in process (the smoke tests) gives its caller its cores back.
        assert os.sched_getaffinity(0) == allowed
        assert os.sched_getaffinity(engine.pid) == split.engine
    finally:
        pin(os.getpid(), allowed)
        engine.kill()
        engine.wait(timeout=10)


def test_targets_read_from_the_arms() -> None:
    def arm(p50: float, p99: float, failed: int = 0, flooder: dict[str, int] | None = None):  # type: ignore[no-untyped-def]
        return {
            "quiet": {"p50_ms": p50, "p99_ms": p99}, "quiet_failed": failed,
            "flooder": {"status": flooder or {}}, "flooder_refused_without_retry_after": 0,
            "cpu_cores": {}, "front": "service",
        }  # fmt: skip

    summary = compare(
        {
            "alone-straight": arm(30.0, 40.0),
            "alone-service": arm(30.8, 42.0),
            "over-full": arm(50.0, 90.0, 0, {"200": 10, "504": 1}),
            "over-first-20ms": arm(45.0, 70.0, 0, {"200": 10, "429": 5, "cut": 2}),
            "over-kvwarden": {**arm(45.0, 60.0), "front": "kvwarden"},
        }
    )
    targets = summary["targets"]
    assert targets["added_p50_ms<=1.0"] and targets["added_p99_ms<=3.0"]
    assert not targets["over_quiet_p99<=2x_solo"]  # 90 / 40 = 2.25
    assert targets["over_zero_failed_quiet"]
    assert not targets["over_flooder_only_200_429_503_with_retry_after"]  # a 504
    # another arm of ours above capacity is judged alike, under its name; a peer's is not
    assert targets["over_quiet_p99<=2x_solo:over-first-20ms"]  # 70 / 40
    assert targets["over_flooder_only_200_429_503_with_retry_after:over-first-20ms"]
    assert not any(key.endswith(":over-kvwarden") for key in targets)
    assert {a.name for a in ARMS} >= {"alone-straight", "over-full", "over-kvwarden"}


def _row(p99: float, flooder_tok_s: float) -> dict[str, object]:
    return {
        "quiet": {"p50_ms": 30.0, "p99_ms": p99}, "quiet_failed": 0,
        "flooder": {"status": {"200": 1}}, "flooder_refused_without_retry_after": 0,
        "cpu_cores": {}, "flooder_output_tok_s": flooder_tok_s,
    }  # fmt: skip


def test_kvwarden_workload_target_needs_the_tail_and_twice_the_peers_flooder_tokens() -> None:
    targets = compare(
        {
            "alone-straight": _row(40.0, 0.0),
            "room-kvwarden": _row(42.0, 600.0),
            "room-fifo": _row(48.0, 2000.0),
            "room-full": _row(60.0, 2000.0),  # 1.5x solo: the tail misses
            "room-first-10ms": _row(43.0, 1300.0),  # 1.075x and 2.17x kvwarden's tokens
            "room-first-30ms": _row(43.0, 1100.0),  # the tail holds, too few tokens
        }
    )["targets"]
    mine = {
        key.split(":")[1]: met
        for key, met in targets.items()
        if key.startswith(KVWARDEN_WORKLOAD_TARGET)
    }
    assert mine == {"room-full": False, "room-first-10ms": True, "room-first-30ms": False}


def test_delta_arms_write_their_objective() -> None:
    arm, tail, over, over_tail = delta_arms(["25ms"], ["15ms"], 0.95)
    assert arm.name == "room-first-25ms" and arm.load == "room" and arm.front == "service"
    assert over.name == "over-first-25ms" and over.load == "over"
    assert over.latency_delta == arm.latency_delta
    policy = policy_from_text(policy_text("127.0.0.1:1", arm.latency_delta))
    delta = policy.source.tier_options["standard"].latency_delta
    assert delta == LatencyDelta(first_token=0.025)
    assert (tail.name, over_tail.name) == ("room-tail-15ms", "over-tail-15ms")
    policy = policy_from_text(policy_text("127.0.0.1:1", tail.latency_delta))
    delta = policy.source.tier_options["standard"].latency_delta
    assert delta == LatencyDelta(every_token=0.015, quantile=0.95)
    assert policy_from_text(policy_text("127.0.0.1:1")).source.tier_options == {}


def test_a_percentile_suffix_makes_a_first_token_quantile_objective() -> None:
    (room, over) = delta_arms(["2x-p99"])
    assert (room.name, over.name) == ("room-first-2x-p99", "over-first-2x-p99")
    policy = policy_from_text(policy_text("127.0.0.1:1", over.latency_delta))
    delta = policy.source.tier_options["standard"].latency_delta
    assert delta == LatencyDelta(first_token=AloneMultiple(2.0), quantile=0.99)
    policy = policy_from_text(
        policy_text("127.0.0.1:1", delta_arms(["30ms-p999"])[0].latency_delta)
    )
    assert policy.source.tier_options["standard"].latency_delta == LatencyDelta(
        first_token=0.03, quantile=0.999
    )
    with pytest.raises(ValueError, match="-p followed by digits"):
        delta_arms(["2x-pxx"])


def test_before_arms_copy_each_objective_arm_onto_the_other_tree(tmp_path: Path) -> None:
    objectives = delta_arms(["20ms"])
    arms = {arm.name: arm for arm in before_arms(tmp_path, objectives)}
    assert set(arms) == {"room-before", "over-before", "room-first-20ms-before",
                         "over-first-20ms-before"}  # fmt: skip
    for arm in objectives:
        copy = arms[f"{arm.name}-before"]
        assert copy.source == tmp_path and copy.latency_delta == arm.latency_delta
        assert copy.load == arm.load and arm.source is None


def test_door_arms_hold_a_static_soft_limit() -> None:
    (arm,) = door_arms([19])
    assert (arm.name, arm.load, arm.front) == ("room-door-19", "room", "service")
    policy = policy_from_text(policy_text("127.0.0.1:1", arm.latency_delta, arm.door_limit))
    pool = next(iter(policy.source.pools.values()))
    assert pool.max_inflight == 27 and pool.headroom == 8
    assert pool.adaptive is not None and pool.adaptive.enabled is False
    default = next(iter(policy_from_text(policy_text("127.0.0.1:1")).source.pools.values()))
    assert default.max_inflight == 512 and default.adaptive is None


def test_paced_arms_run_the_default_capacity_with_a_prefill_budget() -> None:
    names = [(a.name, a.load, a.count_in_envoy) for a in paced_arms([14])]
    assert names == [
        ("room-paced-14", "room", False), ("over-paced-14", "over", False),
        ("room-paced-14-lua", "room", True), ("over-paced-14-lua", "over", True),
    ]  # fmt: skip
    arm = paced_arms([14])[0]
    policy = policy_from_text(
        policy_text("127.0.0.1:1", arm.latency_delta, arm.door_limit, arm.prefill_budget)
    )
    pool = next(iter(policy.source.pools.values()))
    assert pool.effective_prefill_budget == 14
    assert pool.max_inflight == 512 and pool.adaptive is None


def test_the_floods_onset_is_summarized_apart_from_what_follows() -> None:
    """Quiet requests sent in the flood's first ONSET_S seconds (the warm-up included) are
    the onset; the rest of the window is after it."""
    timing = Timing(warmup_s=3.0, measure_s=20.0, grace_s=0.0)
    began = 5.0  # after the priming requests
    records = [
        Record("quiet", began - 1.0, 200, 0.03, began, 10, 64, 0.1),  # priming: in neither
        Record("quiet", began + 1.0, 200, 0.5, began + 2.0, 10, 64, 0.1),
        Record("quiet", began + 8.0, 200, 0.3, began + 9.0, 10, 64, 0.1),
        Record("quiet", began + 12.0, 200, 0.04, began + 13.0, 10, 64, 0.1),
        Record("quiet", began + 22.0, 200, 0.05, began + 23.0, 10, 64, 0.1),
    ]
    result = summarize(ARMS[0], records, timing, {}, began)
    assert result["quiet_onset"]["count"] == 2
    assert result["quiet_onset"]["max_ms"] == pytest.approx(500.0)
    assert result["quiet_after_onset"]["count"] == 2
    assert result["quiet_after_onset"]["max_ms"] == pytest.approx(50.0)
    assert result["quiet"]["count"] == 3  # the measured window starts after the warm-up


def test_each_named_process_is_charged_once(tmp_path: Path) -> None:
    """The load generator's descendants are the stacks it started: a stack named on its own
    is counted under its name, not again under the load generator's. The tree is built fresh
    (load generator -> stack -> a CPU-burning worker), so no other child of the test process
    is in it."""
    pids = tmp_path / "pids"
    stack_script = (
        "import subprocess, sys\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "print(worker.pid, flush=True)\n"
        "worker.wait()\n"
    )
    loadgen_script = (
        "import os, subprocess, sys, time\n"
        f"stack = subprocess.Popen([sys.executable, '-c', {stack_script!r}],"
        " stdout=subprocess.PIPE, text=True)\n"
        "worker = stack.stdout.readline().strip()\n"
        f"open({str(pids)!r} + '.tmp', 'w').write(f'{{stack.pid}} {{worker}}')\n"
        f"os.replace({str(pids)!r} + '.tmp', {str(pids)!r})\n"
        "stack.wait()\n"
    )
    loadgen = subprocess.Popen([sys.executable, "-c", loadgen_script])
    stack_pid = worker_pid = 0
    try:
        deadline = time.monotonic() + 30.0
        while not pids.exists():
            assert loadgen.poll() is None, "the load generator stopped"
            assert time.monotonic() < deadline, "the stack's worker did not start"
            time.sleep(0.01)
        stack_pid, worker_pid = (int(x) for x in pids.read_text().split())
        assert descendants(loadgen.pid, stop_at={stack_pid}) == []
        assert worker_pid in descendants(stack_pid)
        while cpu_seconds(worker_pid) < 0.5:  # the worker has used measurable CPU
            assert time.monotonic() < deadline, "the worker used no CPU"
            time.sleep(0.01)
        charged = group_cpu({"loadgen": loadgen.pid, "stack": stack_pid})
        assert charged["stack"] >= 0.5  # the worker's CPU, under its stack's name
        assert charged["loadgen"] < 0.4  # its own start-up only, not the worker's again
    finally:
        for pid in (worker_pid, stack_pid):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        loadgen.kill()
        loadgen.wait(timeout=10)


def test_lua_arms_count_in_envoy_with_the_same_objective() -> None:
    objectives = delta_arms(["20ms"])
    for arm, lua in zip(objectives, lua_arms(objectives), strict=True):
        assert lua.name == f"{arm.name}-lua" and lua.count_in_envoy and not arm.count_in_envoy
        assert (lua.load, lua.latency_delta, lua.front) == (arm.load, arm.latency_delta, "service")


def test_slice_arms_run_our_front_on_a_short_slice_and_the_others_are_left_out() -> None:
    sliced = {arm.name: arm for arm in slice_arms(ARMS)}
    assert "room-lua-slice" in sliced and "room-fifo-slice" not in sliced
    assert all(arm.front == "service" and arm.cpu_slice_us == 100 for arm in sliced.values())
    assert with_cpu_slice(0, ["envoy", "-c", "x"]) == ["envoy", "-c", "x"]
    wrapped = with_cpu_slice(100, ["envoy", "-c", "x"])
    assert wrapped[1:] == ["-m", "gateway_lab.bench.cpu_slice", "100", "--", "envoy", "-c", "x"]
