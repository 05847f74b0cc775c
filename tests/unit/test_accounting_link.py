"""The accounting events between a child accounting process and its parent, both ends in one
process: frames cut anywhere, output summed per stream and interval, order kept, a lost link
settled, and how far behind a child counts as."""

from __future__ import annotations

import asyncio
import time

from extproc.service.accounting_link import (
    LAG,
    EventApplier,
    ForwardingPort,
    FrameReader,
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

    def charge_output(self, tokens: int, at: float | None = None) -> None:
        self.calls.append(("output", tokens, at))

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
    frames = [[["a", 1, "r1"]], [["o", 1, 7], ["s", 1, None, 7]], [[LAG, 1500]]]
    stream = b"".join(encode_frame(f) for f in frames)
    for cut in range(1, len(stream)):
        reader = FrameReader()
        assert reader.feed(stream[:cut]) + reader.feed(stream[cut:]) == frames


def _replay(sent: list[bytes]) -> RecordingPort:
    parent = RecordingPort()
    applier = EventApplier(parent)
    for frame in FrameReader().feed(b"".join(sent)):
        applier.apply(frame)
    return parent


async def test_output_waits_for_the_interval_and_a_settle_sends_it_first() -> None:
    sent: list[bytes] = []
    child = ForwardingPort(sent.append, output_interval_s=3600.0)
    lease = child.attach("r1")
    assert lease is not None
    lease.response_started(200, "10.0.0.1:8000")
    lease.first_byte(12.5)
    for _ in range(5):  # five chunks read in one event-loop turn
        lease.charge_output(1)
    await asyncio.sleep(0)  # the turn ends: a frame, without the output
    lease.charge_output(2, at=40.0)
    await asyncio.sleep(0)
    assert len(sent) == 1
    lease.settle(Usage(3, 7, 10), 7)
    await asyncio.sleep(0)
    assert len(sent) == 2
    parent = _replay(sent)
    assert parent.attached == ["r1"]
    assert parent.calls == [
        ("started", 200, "10.0.0.1:8000"),
        ("first_byte", 12.5),
        ("output", 7, 40.0),  # one event per stream and interval, timed by its last token
        ("settle", Usage(3, 7, 10), 7),
    ]


async def test_the_interval_sends_each_streams_sum_timed_by_its_last_token() -> None:
    sent: list[bytes] = []
    arrived = asyncio.Event()

    def write(frame: bytes) -> None:
        sent.append(frame)
        if b'"o"' in frame:
            arrived.set()

    child = ForwardingPort(write, output_interval_s=0.01)
    first, second = child.attach("r1"), child.attach("r2")
    assert first is not None and second is not None
    first.charge_output(1)
    second.charge_output(4)
    before = time.monotonic()
    first.charge_output(2)
    after = time.monotonic()
    await asyncio.wait_for(arrived.wait(), 5.0)
    calls = _replay(sent).calls
    assert [call[:2] for call in calls] == [("output", 3), ("output", 4)]
    at = calls[0][2]
    assert isinstance(at, float) and before <= at <= after


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
    applier.apply([[LAG, 20_000]])
    assert applier.behind_s() == 0.02
    applier.apply([[LAG, 0]])
    assert applier.behind_s() == 0.0
    now[0] += 0.6  # silent: a stopped or starved child
    assert 0.45 < applier.behind_s() < 0.55


async def test_behind_counts_how_late_the_last_attach_came() -> None:
    """grpc-core may hand the child new streams late while its loop is on time: the delay
    from the forward to the attach says so."""
    now = [50.0]
    forwarded = {"r1": 47.5}
    applier = EventApplier(RecordingPort(), clock=lambda: now[0], forwarded_at=forwarded.get)
    applier.apply([[LAG, 0], ["a", 1, "r1"]])
    assert applier.behind_s() == 2.5
    applier.apply([["a", 2, "not-ours"]])  # admitted elsewhere: says nothing about the delay
    assert applier.behind_s() == 2.5
    forwarded["r3"] = 49.9
    applier.apply([["a", 3, "r3"]])
    assert abs(applier.behind_s() - 0.1) < 1e-9
