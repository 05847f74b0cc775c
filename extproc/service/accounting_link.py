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
"""The child samples its event-loop lag this often and reports it ([LAG, lag in µs]); the
parent also counts the silence since the last report: a stopped child reports nothing."""
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

    def charge_output(self, tokens: int) -> None:
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


class ForwardingPort:
    """The child's `AccountingPort`: `write` sends one frame per event-loop turn."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._events: list[list[object]] = []
        self._output: list[ForwardedLease] = []
        self._scheduled = False
        self._next_stream = 0

    def attach(self, request_id: str) -> AccountedLease | None:
        self._next_stream += 1
        self.emit([ATTACH, self._next_stream, request_id])
        return ForwardedLease(self, self._next_stream)

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


async def report_lag(port: ForwardingPort) -> None:
    """The child's ticker: its event-loop lag, every LAG_INTERVAL_S, as a LAG event."""
    loop = asyncio.get_running_loop()
    while True:
        expected = loop.time() + LAG_INTERVAL_S
        await asyncio.sleep(LAG_INTERVAL_S)
        lag_us = max(0, round((loop.time() - expected) * 1e6))
        port.emit([LAG, lag_us])


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
        self._heard_at: float | None = None
        self.lost = False

    def behind_s(self) -> float:
        """How far behind the child is: the largest of its last reported loop lag, the silence
        since its last report beyond the reporting interval, and how late the last attach came;
        0 once the link is lost (nothing will attach then) or before the child reported."""
        if self.lost or self._heard_at is None:
            return 0.0
        silence = self._clock() - self._heard_at - 2 * LAG_INTERVAL_S
        return max(self._lag_s, silence, self._attach_delay_s, 0.0)

    @property
    def open_streams(self) -> int:
        return len(self._open)

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
