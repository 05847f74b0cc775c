"""The accounting events between a child accounting process and its parent, both ends in one
process: frames cut anywhere, output summed per batch, order kept, a lost link settled, how far
behind a child counts as, and how often an idle child reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from extproc.service.accounting_link import (
    ATTACH,
    IDLE_LAG_INTERVAL_S,
    LAG,
    LAG_INTERVAL_S,
    EventApplier,
    ForwardingPort,
    FrameReader,
    LagReporter,
    encode_frame,
)
from extproc.service.ports import AccountedLease
from extproc.sse import Usage


class RecordingLease:
    def __init__(self, calls: list[tuple[object, ...]]) -> None:
        self.calls = calls

    def response_started(self, status: int, upstream: str | None) -> None:
        self.calls.append(("started", status, upstream))

    def first_byte(self, at: float) -> None:
        self.calls.append(("first_byte", at))

    def charge_output(self, tokens: int) -> None:
        self.calls.append(("output", tokens))

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        self.calls.append(("settle", usage, output_seen))


class RecordingPort:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.attached: list[str] = []

    def attach(self, request_id: str) -> AccountedLease | None:
        self.attached.append(request_id)
        return RecordingLease(self.calls) if request_id != "unknown" else None


def test_frames_cut_anywhere_come_out_whole() -> None:
    frames = [[["a", 1, "r1"]], [["o", 1, 7], ["s", 1, None, 7]], [[LAG, 1500, 50_000]]]
    stream = b"".join(encode_frame(f) for f in frames)
    for cut in range(1, len(stream)):
        reader = FrameReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == frames


async def test_a_turn_of_output_is_one_event_and_the_settle_comes_after_it() -> None:
    sent: list[bytes] = []
    child = ForwardingPort(sent.append)
    lease = child.attach("r1")
    assert lease is not None
    lease.response_started(200, "10.0.0.1:8000")
    lease.first_byte(12.5)
    for _ in range(5):  # five chunks read in one event-loop turn
        lease.charge_output(1)
    await asyncio.sleep(0)  # the turn ends: one frame
    lease.charge_output(2)
    lease.settle(Usage(3, 7, 10), 7)
    await asyncio.sleep(0)
    assert len(sent) == 2
    parent = RecordingPort()
    applier = EventApplier(parent)
    reader = FrameReader()
    for frame in reader.feed(b"".join(sent)):
        applier.apply(frame)
    assert parent.attached == ["r1"]
    assert parent.calls == [
        ("started", 200, "10.0.0.1:8000"),
        ("first_byte", 12.5),
        ("output", 5),
        ("output", 2),
        ("settle", Usage(3, 7, 10), 7),
    ]
    assert applier.open_streams == 0


async def test_a_lost_link_settles_what_is_open_with_the_output_seen() -> None:
    parent = RecordingPort()
    applier = EventApplier(parent)
    applier.apply([["a", 1, "r1"], ["o", 1, 4], ["a", 2, "unknown"], ["o", 2, 9]])
    assert applier.open_streams == 1  # a request nobody here admitted is not tracked
    assert applier.link_lost() == 1
    assert parent.calls[-1] == ("settle", None, 4)
    assert applier.behind_s() == 0.0  # lost: nothing will attach any more


async def test_behind_is_the_reported_lag_or_the_silence() -> None:
    now = [100.0]
    applier = EventApplier(RecordingPort(), clock=lambda: now[0])
    assert applier.behind_s() == 0.0  # not heard from yet
    applier.apply([[LAG, 20_000, 50_000]])
    assert applier.behind_s() == 0.02
    applier.apply([[LAG, 0, 50_000]])
    assert applier.behind_s() == 0.0
    now[0] += 0.6  # silent: a stopped or starved child
    assert 0.45 < applier.behind_s() < 0.55


async def test_behind_counts_how_late_the_last_attach_came() -> None:
    """grpc-core may hand the child new streams late while its loop is on time: the delay
    from the forward to the attach says so."""
    now = [50.0]
    forwarded = {"r1": 47.5}
    applier = EventApplier(RecordingPort(), clock=lambda: now[0], forwarded_at=forwarded.get)
    applier.apply([[LAG, 0, 50_000], ["a", 1, "r1"]])
    assert applier.behind_s() == 2.5
    applier.apply([["a", 2, "not-ours"]])  # admitted elsewhere: says nothing about the delay
    assert applier.behind_s() == 2.5
    forwarded["r3"] = 49.9
    applier.apply([["a", 3, "r3"]])
    assert abs(applier.behind_s() - 0.1) < 1e-9


async def test_an_idle_child_may_be_silent_as_announced_but_not_after_a_forward() -> None:
    now = [10.0]
    applier = EventApplier(RecordingPort(), clock=lambda: now[0])
    applier.apply([[LAG, 0, 500_000]])  # no stream open: the next report in 0.5 s
    now[0] += 0.9
    assert applier.behind_s() == 0.0  # within twice the announced interval
    assert applier.behind_s(forwarded_at=9.0) == 0.0  # forwarded before the last report
    # Forwarded 0.8 s ago and nothing heard since: a live child would have attached and
    # reported at the busy interval, so it is 0.8 - 2 x 0.05 s behind.
    assert abs(applier.behind_s(forwarded_at=10.1) - 0.7) < 1e-9
    now[0] += 0.5
    assert abs(applier.behind_s() - 0.4) < 1e-9  # 1.4 s of silence against 2 x 0.5 s


def _lag_events(frames: list[bytes]) -> list[list[object]]:
    reader = FrameReader()
    return [e for f in reader.feed(b"".join(frames)) for e in f if e[0] in (LAG, ATTACH)]


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_the_child_reports_seldom_while_idle_and_at_once_when_a_stream_attaches() -> None:
    busy, idle = round(LAG_INTERVAL_S * 1e6), round(IDLE_LAG_INTERVAL_S * 1e6)
    frames: list[bytes] = []
    port = ForwardingPort(frames.append)
    reporter = LagReporter(port)
    reporter.start()
    try:
        await _until(lambda: len(_lag_events(frames)) >= 2, "the first sample")
        assert [e[2] for e in _lag_events(frames)[:2]] == [busy, idle]
        lease = port.attach("r1")
        assert lease is not None

        def after_attach() -> list[list[object]]:
            events = _lag_events(frames)
            at = next((i for i, e in enumerate(events) if e[0] == ATTACH), len(events))
            return events[at:]

        await _until(lambda: len(after_attach()) >= 2, "the report with the attach")
        events = _lag_events(frames)
        at = len(events) - len(after_attach())
        # Reported with the attach, long before the idle interval is over, and at the busy
        # interval while the stream is open.
        assert events[at + 1][0] == LAG and events[at + 1][2] == busy
        await _until(lambda: len(_lag_events(frames)) >= at + 4, "two busy samples")
        assert [e[2] for e in _lag_events(frames)[at + 2 : at + 4]] == [busy, busy]
        lease.settle(None, 0)
        count = len(_lag_events(frames))
        await _until(lambda: len(_lag_events(frames)) > count, "the sample after the settle")
        assert _lag_events(frames)[-1][2] == idle
    finally:
        reporter.stop()
