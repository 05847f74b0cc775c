"""The accounting events between a child accounting process and its parent, both ends in one
process: frames cut anywhere, output summed per batch, order kept, a lost link settled, and
how far behind a child counts as."""

from __future__ import annotations

import asyncio

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
    frames = [[["a", 1, "r1"]], [["o", 1, 7], ["s", 1, None, 7]], [[LAG, 1500]]]
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
