"""Envoy's `request.time` on the request-headers message: parsed from Envoy's own format, judged
against the smallest delay seen (clocks of different hosts differ), and a first message that
reached the handler later than the message-age limit makes the service shed."""

from __future__ import annotations

from datetime import UTC, datetime

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from google.protobuf.struct_pb2 import Struct

from extproc.policy.model import Gateway, Overload
from extproc.service.arrival import (
    BASELINE_DRIFT_PER_S,
    EXT_PROC_ATTRIBUTES,
    REQUEST_TIME_ATTRIBUTE,
    ArrivalDelay,
    envoy_received_at,
)
from extproc.service.overload import OverloadDetector


def with_time(text: str | None, key: str = EXT_PROC_ATTRIBUTES) -> ProcessingRequest:
    request = ProcessingRequest()
    request.request_headers.end_of_stream = False
    if text is not None:
        attributes = Struct()
        attributes.update({REQUEST_TIME_ATTRIBUTE: text})
        request.attributes[key].CopyFrom(attributes)
    return request


def test_envoys_request_time_is_read_as_epoch_seconds() -> None:
    # The form Envoy 1.40 sends (seen from the real binary: RFC 3339, microseconds, +00:00).
    received = envoy_received_at(with_time("2026-12-04T21:58:11.644328+00:00"))
    expected = datetime(2026, 12, 4, 21, 58, 11, 644328, tzinfo=UTC).timestamp()
    assert received is not None and abs(received - expected) < 1e-6
    zulu = envoy_received_at(with_time("2026-12-04T21:58:11.5Z"))
    assert zulu is not None and abs(zulu - (expected - 0.144328)) < 1e-6


def test_absent_or_unplaceable_times_are_none() -> None:
    assert envoy_received_at(with_time(None)) is None
    assert envoy_received_at(with_time("2026-12-04T21:58:11")) is None  # no zone: no moment
    assert envoy_received_at(with_time("yesterday")) is None
    assert envoy_received_at(with_time("2026-12-04T21:58:11Z", key="another.filter")) is None


def test_the_excess_is_over_the_smallest_delay_whatever_the_clock_offset() -> None:
    delays = ArrivalDelay()
    skew = 7.0  # Envoy's clock 7 s behind ours
    assert delays.excess(skew + 0.003, now=0.0) == 0.0
    assert abs(delays.excess(skew + 0.002, now=1.0) - 0.0) < 1e-9  # a new, smaller baseline
    assert abs(delays.excess(skew + 1.502, now=2.0) - (1.5 - BASELINE_DRIFT_PER_S)) < 1e-9


def test_the_baseline_creeps_up_so_a_changed_offset_is_absorbed() -> None:
    delays = ArrivalDelay()
    delays.excess(0.002, now=0.0)
    # The offset grew by 0.2 s (a clock step): at first it looks like lateness ...
    assert delays.excess(0.202, now=1.0) > 0.19
    # ... and after 200 s of the same delays it no longer does.
    for second in range(2, 203):
        excess = delays.excess(0.202, now=float(second))
    assert excess == 0.0


def detector() -> tuple[OverloadDetector, list[float], list[float]]:
    now = [100.0]
    settings = Gateway(message_timeout=2.0, overload=Overload(lag_threshold_ms=5000))
    found = OverloadDetector(settings, lambda: {"flood"}, lambda: now[0])
    seen: list[float] = []
    found.on_arrival = seen.append
    return found, now, seen


def test_a_first_message_older_than_the_age_limit_sheds_at_the_next_sample() -> None:
    found, now, seen = detector()  # age limit: 0.5 x 2 s
    found.arrived(0.004)
    now[0] += 0.01
    assert not found.observe(0.0)
    found.arrived(0.9)  # late, but under the limit
    now[0] += 0.01
    assert not found.observe(0.0)
    found.arrived(1.3)
    now[0] += 0.01
    assert found.observe(0.0)
    assert found.reason == "message_age" and found.sheds("flood") and not found.sheds("quiet")
    assert seen == [0.004, 0.9, 1.3]  # every delay reaches the histogram


def test_a_late_arrival_counts_once_and_shedding_ends_after_recovery() -> None:
    found, now, _ = detector()
    found.arrived(0.004)
    found.arrived(1.6)
    assert found.observe(0.0)
    now[0] += 1.1  # recover_ms (1 s) with no signal: the late arrival is not counted again
    assert not found.observe(0.0)
    assert found.reason is None
