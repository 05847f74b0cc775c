"""The accounting events a child accounting process sends its admitting process, and both ends.

Under streaming load most of the service's messages are response chunks on accounting streams
(one gRPC message per chunk), while the messages Envoy waits on are the admission streams'.
On one event loop the admission messages queue behind the chunks, and when the core is
saturated Envoy times them out (an empty 504). `extproc serve --accounting-grpc ADDRESS` runs
the accounting streams in a child process (extproc.service.accounting_process) with a gRPC
server of its own: the per-chunk work leaves the admission loop, and what reaches it are
compact, batched events on a socket pair:

    attach (stream, request id), response started (status, upstream), first byte (when),
    output (tokens, summed over a batch), settle (usage or none, output seen)

`ForwardingPort` is the child's `AccountingPort`: its leases append events to a batch that is
written once per event-loop turn. `EventApplier` is the parent's end: it replays the events
on the real port (extproc.service.gateway), so settlement, first-token pacing and every metric
are what they are with the in-process accounting. A lost link settles every open lease with
what it was told, so no capacity leaks when the child dies.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable

import orjson

from extproc.service.ports import AccountedLease, AccountingPort
from extproc.sse import Usage

log = logging.getLogger("extproc.accounting_link")

ATTACH, STARTED, FIRST_BYTE, OUTPUT, SETTLE, READY, LAG = "a", "r", "f", "o", "s", "ready", "l"
LAG_INTERVAL_S = 0.05
"""While a stream is open the child samples its event-loop lag this often and reports it
([LAG, lag in µs, µs to the next report]); the parent also counts the silence beyond twice
that announced interval: a stopped child reports nothing."""
IDLE_LAG_INTERVAL_S = 0.5
"""With no stream open the child reports this seldom: an idle service's two processes would
otherwise both wake 20 times a second for nothing. A stream's attach brings the busy interval
back at once, and the parent counts the silence since a forward at the busy interval."""
_HEADER = struct.Struct("!I")
MAX_FRAME = 64 * 1024 * 1024


def encode_frame(events: list[list[object]]) -> bytes:
    body = orjson.dumps(events)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Length-prefixed frames out of a byte stream that arrives in arbitrary pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[list[list[object]]]:
        buffer = self._buffer
        buffer += data
        frames = []
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME:
                raise ValueError(f"accounting frame of {size} bytes")
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            frames.append(orjson.loads(bytes(buffer[start + _HEADER.size : end])))
            start = end
        del buffer[:start]
        return frames


def _int(value: object) -> int:
    if isinstance(value, int):
        return value
    raise ValueError(f"expected an integer, got {value!r}")


def _usage_fields(usage: Usage | None) -> list[int | None] | None:
    if usage is None:
        return None
    return [usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens]


def _usage_of(fields: object) -> Usage | None:
    if not isinstance(fields, list):
        return None
    prompt, completion, total, cached = fields
    return Usage(
        _int(prompt), _int(completion), _int(total), None if cached is None else _int(cached)
    )


# -- the child's end ---------------------------------------------------------------------------


class ForwardedLease:
    """A lease in the child: every call becomes an event; output is summed per batch."""

    def __init__(self, port: ForwardingPort, stream: int) -> None:
        self._port = port
        self._stream = stream
        self.pending_output = 0

    def response_started(self, status: int, upstream: str | None) -> None:
        self._port.emit([STARTED, self._stream, status, upstream])

    def first_byte(self, at: float) -> None:
        # CLOCK_MONOTONIC is one clock for every process of the host.
        self._port.emit([FIRST_BYTE, self._stream, at])

    def charge_output(self, tokens: int, largest_gap: float | None = None) -> None:
        del largest_gap  # an accounting stream's chunks come one by one: never given
        if not self.pending_output:
            self._port.output_pending(self)
        self.pending_output += tokens

    def flush_output(self) -> None:
        if self.pending_output:
            self._port.emit([OUTPUT, self._stream, self.pending_output], schedule=False)
            self.pending_output = 0

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        self.flush_output()
        self._port.emit([SETTLE, self._stream, _usage_fields(usage), output_seen])
        self._port.settled()


class ForwardingPort:
    """The child's `AccountingPort`: `write` sends one frame per event-loop turn."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._events: list[list[object]] = []
        self._output: list[ForwardedLease] = []
        self._scheduled = False
        self._next_stream = 0
        self.open_streams = 0
        """Attached and not settled yet."""
        self.attached: Callable[[], None] = lambda: None
        """Called on every attach (the lag reporter leaves its idle interval)."""

    def attach(self, request_id: str) -> AccountedLease | None:
        self._next_stream += 1
        self.open_streams += 1
        self.emit([ATTACH, self._next_stream, request_id])
        self.attached()
        return ForwardedLease(self, self._next_stream)

    def settled(self) -> None:
        self.open_streams -= 1

    def emit(self, event: list[object], schedule: bool = True) -> None:
        self._events.append(event)
        if schedule:
            self._schedule()

    def output_pending(self, lease: ForwardedLease) -> None:
        self._output.append(lease)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            # After the callbacks ready now (the chunks already read): one frame per turn.
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        for lease in self._output:
            lease.flush_output()
        self._output.clear()
        if self._events:
            events, self._events = self._events, []
            self._write(encode_frame(events))


class LagReporter:
    """The child's ticker (a loop timer, no task): its event-loop lag as a LAG event, every
    LAG_INTERVAL_S while a stream is open, every IDLE_LAG_INTERVAL_S otherwise; an attach
    during an idle interval reports at once and brings the busy interval back."""

    def __init__(self, port: ForwardingPort) -> None:
        self._port = port
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._interval_s = LAG_INTERVAL_S
        self._lag_us = 0
        port.attached = self._attached

    def start(self) -> None:
        self._report(LAG_INTERVAL_S)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _report(self, interval_s: float) -> None:
        self._port.emit([LAG, self._lag_us, round(interval_s * 1e6)])
        self._interval_s = interval_s
        self._due = self._loop.time() + interval_s
        self._timer = self._loop.call_at(self._due, self._sample)

    def _sample(self) -> None:
        self._lag_us = max(0, round((self._loop.time() - self._due) * 1e6))
        self._report(LAG_INTERVAL_S if self._port.open_streams else IDLE_LAG_INTERVAL_S)

    def _attached(self) -> None:
        if self._interval_s > LAG_INTERVAL_S and self._timer is not None:
            self._timer.cancel()
            self._report(LAG_INTERVAL_S)  # with the last lag measured


# -- the parent's end --------------------------------------------------------------------------


class _Open:
    __slots__ = ("lease", "output_seen")

    def __init__(self, lease: AccountedLease) -> None:
        self.lease = lease
        self.output_seen = 0


class EventApplier:
    """The admitting process's end: the child's events, replayed on the real port."""

    def __init__(
        self,
        port: AccountingPort,
        clock: Callable[[], float] = time.monotonic,
        forwarded_at: Callable[[str], float | None] = lambda request_id: None,
    ) -> None:
        self._port = port
        self._clock = clock
        self._forwarded_at = forwarded_at
        self._attach_delay_s = 0.0
        """From the forward to the child's attach, for the last request this process admitted:
        how late attaches come now (grpc-core may hand the child new streams late while its
        loop is on time, so its lag alone does not say it)."""
        self._open: dict[int, _Open] = {}
        self.ready = asyncio.get_running_loop().create_future()
        """Resolves to the child's gRPC port once it serves."""
        self._lag_s = 0.0
        self._interval_s = LAG_INTERVAL_S
        """Until the next report, as the child announced it."""
        self._heard_at: float | None = None
        self.lost = False

    def behind_s(self, forwarded_at: float | None = None) -> float:
        """How far behind the child is: the largest of its last reported loop lag, the silence
        since its last report beyond twice the interval it announced, and how late the last
        attach came; 0 once the link is lost (nothing will attach then) or before the child
        reported. `forwarded_at`: a request forwarded then has not attached yet; if nothing
        was heard since, a live child would have attached and reported at the busy interval,
        so the silence since the forward counts against that interval."""
        if self.lost or self._heard_at is None:
            return 0.0
        now = self._clock()
        silence = now - self._heard_at - 2 * self._interval_s
        if forwarded_at is not None and forwarded_at > self._heard_at:
            silence = max(silence, now - forwarded_at - 2 * LAG_INTERVAL_S)
        return max(self._lag_s, silence, self._attach_delay_s, 0.0)

    @property
    def open_streams(self) -> int:
        return len(self._open)

    @property
    def report_interval_s(self) -> float:
        """The child's next report is due this long after its last one (it said so)."""
        return self._interval_s

    def apply(self, events: list[list[object]]) -> None:
        self._heard_at = self._clock()
        for event in events:
            try:
                self._apply(event)
            except Exception:
                log.exception("accounting event %r failed", event[:2])

    def _apply(self, event: list[object]) -> None:
        kind, stream = event[0], _int(event[1])
        if kind == ATTACH:
            request_id = str(event[2])
            forwarded = self._forwarded_at(request_id)
            if forwarded is not None:
                self._attach_delay_s = max(0.0, self._clock() - forwarded)
            lease = self._port.attach(request_id)
            if lease is not None:
                self._open[stream] = _Open(lease)
            return
        if kind == LAG:
            self._lag_s = stream / 1e6
            self._interval_s = _int(event[2]) / 1e6
            return
        if kind == READY:
            if not self.ready.done():
                self.ready.set_result(stream)
            return
        entry = self._open.get(stream)
        if entry is None:
            return
        if kind == OUTPUT:
            tokens = _int(event[2])
            entry.output_seen += tokens
            entry.lease.charge_output(tokens)
        elif kind == FIRST_BYTE:
            at = event[2]
            entry.lease.first_byte(float(at) if isinstance(at, int | float) else 0.0)
        elif kind == STARTED:
            upstream = event[3]
            entry.lease.response_started(
                _int(event[2]), None if upstream is None else str(upstream)
            )
        elif kind == SETTLE:
            del self._open[stream]
            entry.lease.settle(_usage_of(event[2]), _int(event[3]))

    def link_lost(self) -> int:
        """The child is gone: settle every open lease with the output it reported."""
        self.lost = True
        lost, self._open = self._open, {}
        for entry in lost.values():
            try:
                entry.lease.settle(None, entry.output_seen)
            except Exception:
                log.exception("settling after the accounting link was lost failed")
        return len(lost)


class ApplierProtocol(asyncio.Protocol):
    """The parent's socket: frames in, events applied; the end of the link settles the rest."""

    def __init__(self, applier: EventApplier, lost: Callable[[], None]) -> None:
        self._applier = applier
        self._reader = FrameReader()
        self._lost = lost

    def data_received(self, data: bytes) -> None:
        for frame in self._reader.feed(data):
            self._applier.apply(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self._lost()
