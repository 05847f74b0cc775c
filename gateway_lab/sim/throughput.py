"""Saturation throughput of one engine configuration on a given request mix.

One engine gets a backlog of requests at time 0 and steps until its waiting queue is empty;
throughput is what completed per second while the engine was saturated. The ratio of two
configurations' throughputs on the same (short) requests is the `rho` of the dual-pool cost
model `savings = alpha * (1 - 1/rho)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway_lab.engine.model import EngineCore
from gateway_lab.engine.profiles import EngineProfile
from gateway_lab.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Throughput:
    requests_per_s: float
    output_tokens_per_s: float
    input_tokens_per_s: float
    requests: int
    """Requests completed in the measured (saturated) interval."""
    seconds: float
    mean_batch: float
    """Mean number of decoding sequences per step over the whole run."""


def evenly(requests: Sequence[TraceRequest], count: int) -> list[TraceRequest]:
    """At most `count` requests spread evenly over the sequence (deterministic)."""
    if count <= 0 or not requests:
        return []
    if len(requests) <= count:
        return list(requests)
    step = len(requests) / count
    return [requests[int(i * step)] for i in range(count)]


def saturation_throughput(
    profile: EngineProfile, requests: Sequence[TraceRequest], *, sample: int = 2000
) -> Throughput:
    """Throughput of one `profile` engine kept saturated with (a sample of) `requests`.

    Requests that do not fit the profile's max_model_len are left out. The rate is measured
    between the completion of the first tenth of the requests (past the start-up burst) and the
    last completion that happened while requests were still waiting (before the drain), so
    neither the ramp-up nor the half-empty tail counts.
    """
    chosen = [r for r in evenly(requests, sample) if r.total_tokens <= profile.max_model_len]
    if not chosen:
        raise ValueError(f"no request fits max_model_len {profile.max_model_len}")
    core = EngineCore(profile)
    for index, request in enumerate(chosen):
        core.add_request(
            str(index), request.input_tokens, request.output_tokens, priority=request.priority
        )
    now = 0.0
    marks: list[tuple[float, int, int, int]] = []
    """(time, completed, output tokens, input tokens) after each step that completed some."""
    done = out_tokens = in_tokens = 0
    decodes = steps = 0
    saturated_marks = 0
    while core.has_work:
        result = core.step(now)
        now = result.end
        steps += 1
        decodes += result.num_decodes
        out_tokens += len(result.output)
        if result.finished:
            done += len(result.finished)
            in_tokens += sum(f.prompt_tokens for f in result.finished)
            marks.append((now, done, out_tokens, in_tokens))
            if core.num_waiting > 0:
                saturated_marks = len(marks)
    first = next((m for m in marks if m[1] >= len(chosen) // 10), marks[0])
    last = marks[saturated_marks - 1] if saturated_marks else marks[-1]
    if last[0] <= first[0]:  # everything ran in one batch: use the whole run
        first, last = (0.0, 0, 0, 0), marks[-1]
    seconds = last[0] - first[0]
    return Throughput(
        requests_per_s=(last[1] - first[1]) / seconds,
        output_tokens_per_s=(last[2] - first[2]) / seconds,
        input_tokens_per_s=(last[3] - first[3]) / seconds,
        requests=last[1] - first[1],
        seconds=seconds,
        mean_batch=decodes / steps if steps else 0.0,
    )
