"""The service's end of counting in Envoy (extproc.service.envoy_counts): calls and the end
in any order, cumulative counts, the silent settled, access-log entries read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage

from extproc.envoy_lua import (
    COUNTING_SCRIPT,
    EVENTS_CLUSTER,
    EVERY,
    METADATA_NAMESPACE,
    counting_script,
)
from extproc.service.envoy_counts import (
    LOST_AFTER_S,
    UNSURE_AFTER_S,
    AccessLogSink,
    EnvoyCounts,
    count_and_gap,
    end_of,
)
from extproc.sse import Usage


@dataclass
class FakeLease:
    calls: list[tuple[object, ...]] = field(default_factory=list)

    def response_started(self, status: int, upstream: str | None) -> None:
        self.calls.append(("started", status, upstream))

    def first_byte(self, at: float) -> None:
        self.calls.append(("first", at))

    def charge_output(self, tokens: int, largest_gap: float | None = None) -> None:
        self.calls.append(
            ("charge", tokens) if largest_gap is None else ("charge", tokens, largest_gap)
        )

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        self.calls.append(("settle", usage, output_seen))


class Port:
    """Requests admitted and not settled yet; a settled one attaches no more."""

    def __init__(self, *ids: str) -> None:
        self.leases = {request_id: FakeLease() for request_id in ids}
        self.settled: set[str] = set()

    def attach(self, request_id: str) -> FakeLease | None:
        if request_id in self.settled:
            return None
        lease = self.leases.get(request_id)
        if lease is not None and any(c[0] == "settle" for c in lease.calls):
            self.settled.add(request_id)
            return None
        return lease


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_calls_in_order_charge_what_is_new_and_the_end_settles() -> None:
    port, clock = Port("r1"), Clock()
    counts = EnvoyCounts(port, clock)
    counts.attach("r1")
    clock.now = 100.5
    counts.first("r1", 1)
    counts.output("r1", 16)
    counts.output("r1", 32)
    usage = Usage(7, 40, 47, None)
    counts.ended("r1", 200, "127.0.0.1:9", usage, 40)
    assert port.leases["r1"].calls == [
        ("first", 100.5), ("charge", 1), ("charge", 15), ("charge", 16),
        ("started", 200, "127.0.0.1:9"), ("settle", usage, 40),
    ]  # fmt: skip
    assert counts.open_requests == 0


def test_late_and_reordered_calls_charge_nothing_twice() -> None:
    port = Port("r1")
    counts = EnvoyCounts(port, Clock())
    counts.output("r1", 32)  # before the attach and the first
    counts.first("r1", 1)
    counts.output("r1", 16)
    counts.attach("r1")
    assert port.leases["r1"].calls == [("charge", 32), ("first", 100.0)]
    counts.ended("r1", 200, None, None, 33)
    counts.output("r1", 48)  # after the end: the request is gone
    counts.first("r1", 1)
    assert port.leases["r1"].calls[-1] == ("settle", None, 33)
    assert counts.open_requests == 0


def test_an_end_without_calls_settles_and_a_status_of_zero_is_no_response() -> None:
    port = Port("r1", "r2")
    counts = EnvoyCounts(port, Clock())
    counts.ended("r1", 0, None, None, 0)  # the client left before the response headers
    counts.ended("r2", 503, "127.0.0.1:9", None, 0)
    counts.ended("unknown", 200, None, None, 5)
    assert port.leases["r1"].calls == [("settle", None, 0)]
    assert port.leases["r2"].calls == [("started", 503, "127.0.0.1:9"), ("settle", None, 0)]


def test_a_request_whose_end_never_comes_is_settled_after_the_silence() -> None:
    port, clock = Port("quiet", "talking"), Clock()
    counts = EnvoyCounts(port, clock)
    counts.log_stream_opened()  # Envoy's access log is open here, as in steady state
    counts.first("quiet", 3)
    counts.attach("talking")
    clock.now += LOST_AFTER_S - 1
    counts.output("talking", 16)
    assert counts.settle_silent() == 0
    clock.now += 2
    assert counts.settle_silent() == 1
    assert port.leases["quiet"].calls[-1] == ("settle", None, 3)
    assert counts.open_requests == 1


def test_without_an_access_log_stream_a_request_past_its_first_token_settles_sooner() -> None:
    """In a rolling update Envoy's access-log stream stays with the old pod while the new one
    admits: the new pod's ends go there. What it attached then is settled after a short
    silence past its first token, not after ten minutes of held capacity."""
    port, clock = Port("streaming", "waiting", "talking"), Clock()
    counts = EnvoyCounts(port, clock)
    counts.first("streaming", 16)
    counts.attach("waiting")  # no first token yet: it may sit in the engine's queue
    counts.first("talking", 1)
    clock.now += UNSURE_AFTER_S - 1
    counts.output("talking", 16)
    assert counts.settle_silent() == 0
    clock.now += 2
    assert counts.settle_silent() == 1
    assert port.leases["streaming"].calls[-1] == ("settle", None, 16)
    assert counts.open_requests == 2
    clock.now += LOST_AFTER_S
    assert counts.settle_silent() == 2


async def test_requests_attached_while_an_access_log_stream_is_open_keep_the_long_silence() -> None:
    port, clock = Port("during", "after"), Clock()
    counts = EnvoyCounts(port, clock)
    sink = AccessLogSink(counts)
    opened, release = asyncio.Event(), asyncio.Event()

    async def messages() -> AsyncIterator[StreamAccessLogsMessage]:
        opened.set()
        await release.wait()
        for message in ():
            yield message

    stream = asyncio.create_task(sink.StreamAccessLogs(messages(), None))
    await opened.wait()
    counts.first("during", 1)  # Envoy's stream is open here: its end will come on it
    release.set()
    await stream
    counts.first("after", 1)  # the stream has closed
    clock.now += UNSURE_AFTER_S + 1
    assert counts.settle_silent() == 1
    assert port.leases["after"].calls[-1] == ("settle", None, 1)
    assert port.leases["during"].calls == [("first", 100.0), ("charge", 1)]


def test_a_calls_longest_gap_goes_with_its_charge_and_bodies_are_checked() -> None:
    port = Port("r1")
    counts = EnvoyCounts(port, Clock())
    counts.first("r1", 1)
    counts.output("r1", 17, 70_000)
    counts.output("r1", 17, 90_000)  # nothing new: no charge, whatever the gap
    assert port.leases["r1"].calls[-1] == ("charge", 16, 0.07)
    assert count_and_gap("17 70000") == (17, 70_000)
    assert count_and_gap("17") == (17, None)
    for bad in ("", "x", "17 x", "17 -1", "-1 5", "123456789", "17 1234567890123", "²", "1 ²"):
        assert count_and_gap(bad) is None, bad


def test_late_attach_calls_and_a_lagging_loop_say_how_far_behind_counting_is() -> None:
    port, clock = Port("r1", "r2"), Clock()
    forwarded = {"r1": 100.0, "r2": 104.0}
    lag = [0.0]
    counts = EnvoyCounts(port, clock, forwarded.get, lambda: lag[0])
    assert counts.behind_s() == 0.0
    clock.now = 102.5
    counts.attach("r1")  # 2.5 s after its forward
    assert counts.behind_s(104.0) == 2.5
    lag[0] = 3.0
    assert counts.behind_s() == 3.0
    lag[0] = 0.0
    clock.now = 104.01
    counts.first("r2", 1)  # the next attach came on time: it sets the figure
    assert counts.behind_s() == pytest.approx(0.01)
    counts.attach("unknown")  # not admitted here: no figure
    assert counts.behind_s() == pytest.approx(0.01)


def _entry(**metadata: object) -> HTTPAccessLogEntry:
    entry = HTTPAccessLogEntry()
    entry.response.response_code.value = 200
    address = entry.common_properties.upstream_remote_address.socket_address
    address.address, address.port_value = "127.0.0.1", 8001
    entry.common_properties.metadata.filter_metadata[METADATA_NAMESPACE].update(metadata)
    return entry


def test_an_access_log_entry_reads_as_the_end_of_its_request() -> None:
    assert end_of(HTTPAccessLogEntry()) is None  # a stream the script did not follow
    assert end_of(_entry(tokens=4.0)) is None  # no id
    assert end_of(_entry(id="r1", tokens=12.0)) == (
        "r1", 200, "127.0.0.1:8001", None, 12, None,
    )  # fmt: skip
    assert end_of(
        _entry(id="r1", tokens=40.0, completion=40.0, prompt=7.0, total=47.0, cached=0.0)
    ) == ("r1", 200, "127.0.0.1:8001", Usage(7, 40, 47, 0), 40, None)
    # Numbers out of range or of the wrong kind are no usage.
    assert end_of(_entry(id="r1", completion=-1.0, tokens="x")) == (
        "r1", 200, "127.0.0.1:8001", None, 0, None,
    )  # fmt: skip


def test_the_first_chunks_time_reads_as_how_long_before_the_end_it_passed() -> None:
    start_us = 1_765_000_000_000_000
    entry = _entry(id="r1", tokens=3.0, first_us=float(start_us + 250_000))
    entry.common_properties.start_time.FromMicroseconds(start_us)
    entry.common_properties.duration.FromMicroseconds(400_000)
    end = end_of(entry)
    assert end is not None and end.first_ago == pytest.approx(0.15)
    # Without the stream's duration, its last byte to the client ends it.
    entry.common_properties.ClearField("duration")
    entry.common_properties.time_to_last_downstream_tx_byte.FromMicroseconds(300_000)
    end = end_of(entry)
    assert end is not None and end.first_ago == pytest.approx(0.05)
    # A time outside the stream (another clock), or no time at all, says nothing.
    outside = _entry(id="r1", first_us=float(start_us - 1))
    outside.common_properties.start_time.FromMicroseconds(start_us)
    outside.common_properties.duration.FromMicroseconds(400_000)
    assert (end := end_of(outside)) is not None and end.first_ago is None
    assert (end := end_of(_entry(id="r1", first_us=float(start_us)))) is not None
    assert end.first_ago is None


def test_an_end_that_overtakes_the_first_call_gives_the_first_token_its_own_time() -> None:
    port, clock = Port("late", "on-time", "unattached"), Clock()
    counts = EnvoyCounts(port, clock)
    counts.attach("late")
    counts.first("on-time", 1)
    clock.now = 101.0
    counts.ended("late", 200, None, None, 3, 0.25)
    counts.ended("on-time", 200, None, None, 3, 0.25)  # its call came: that time stands
    counts.ended("unattached", 200, None, None, 2, 0.5)
    counts.first("late", 1)  # the overtaken call, after the end: nothing
    assert port.leases["late"].calls == [
        ("started", 200, None), ("first", 100.75), ("settle", None, 3),
    ]  # fmt: skip
    assert [c[0] for c in port.leases["on-time"].calls].count("first") == 1
    assert port.leases["unattached"].calls[1] == ("first", 100.5)


def test_the_script_calls_its_cluster_with_the_named_constants() -> None:
    assert f'local EVENTS = "{EVENTS_CLUSTER}"' in COUNTING_SCRIPT
    assert f"local EVERY = {EVERY}" in COUNTING_SCRIPT
    assert "__" not in COUNTING_SCRIPT  # every placeholder filled


def test_the_script_calls_the_cluster_it_is_given_and_refuses_a_name_that_would_break_it() -> None:
    istio = "outbound|50053||extproc.llm-gateway.svc.cluster.local"
    script = counting_script(istio)
    assert script.startswith(f'local EVENTS = "{istio}"\n')  # no blank first line in YAML
    assert script.replace(istio, EVENTS_CLUSTER) == COUNTING_SCRIPT
    for name in ('a"b', "a\\b", "a b", "", 'x"; os.exit() --'):
        with pytest.raises(ValueError, match="not a cluster name"):
            counting_script(name)


def test_a_call_after_its_requests_end_never_reaches_the_port() -> None:
    """With shared state an unknown id would be taken for a request another process admitted
    (a round trip to the store for nothing): an id that ended here is dropped."""

    class CountingPort(Port):
        def __init__(self, *ids: str) -> None:
            super().__init__(*ids)
            self.attached: list[str] = []

        def attach(self, request_id: str) -> FakeLease | None:
            self.attached.append(request_id)
            return super().attach(request_id)

    port = CountingPort("r1", "r2")
    counts = EnvoyCounts(port, Clock())
    counts.attach("r1")
    counts.ended("r1", 200, None, None, 5)
    counts.first("r1", 1)
    counts.output("r1", 16, 900)
    counts.ended("r1", 200, None, None, 5)  # a duplicate end settles nothing twice
    counts.ended("r2", 200, None, None, 2)  # ended before any call: attached by its end
    counts.output("r2", 2)
    assert port.attached == ["r1", "r2"]
    assert [c[0] for c in port.leases["r1"].calls] == ["started", "settle"]
    assert counts.open_requests == 0


def test_several_workers_get_the_calls_of_the_requests_they_admitted() -> None:
    script = counting_script(workers=3)
    assert "local WORKERS = 3\n" in script and "__" not in script
    # Each call goes to the cluster of the worker named in the id (the path ends with it),
    # and only ids naming a worker below 3, in canonical form, are followed.
    assert 'handle:httpCall(EVENTS .. "_" .. string.match(path, WORKER_IN_ID),' in script
    assert 'local WORKER_IN_ID = "w(%d+)%-%d+$"' in script
    assert "tonumber(worker) >= WORKERS" in script
    assert 'set(NS, "worker", worker)' in script
    assert counting_script(workers=1) == COUNTING_SCRIPT  # one worker: unchanged
