"""The service's end of counting in Envoy (extproc.envoy_lua): the events listener and the
gRPC access-log sink, both turned into the same `AccountingPort` calls an accounting stream
makes (extproc.service.accounting).

* `POST /attach/<id>` (the request passed Envoy after its admission): `port.attach`;
* `POST /first/<id>` with the output so far: `first_byte` (timed on arrival here), then the
  output charged;
* `POST /output/<id>` with the output so far and the longest gap between two of its chunks
  (µs): the part not charged yet, with that gap (the token δ, the inter-token histogram);
* the access-log entry of the stream's end: the upstream status, then `settle` with the engine's
  usage if the script saw it, else the count of what passed.

The three calls and the log travel on different connections, so they may arrive in any order:
counts are cumulative (a late, smaller one charges nothing), the end settles whether or not an
attach came first, and a call after the end is dropped (`ENDED_KEPT`). A request whose end
never comes (its access log lost with Envoy) is settled with what it was told after
`LOST_AFTER_S` of silence, so its capacity does not leak; sooner, `UNSURE_AFTER_S` after its
last call, when it passed its first token while no access-log stream was open to this
process, so its end may have gone to another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import grpc
from envoy.data.accesslog.v3.accesslog_pb2 import AccessLogCommon, HTTPAccessLogEntry
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage, StreamAccessLogsResponse
from google.protobuf.struct_pb2 import Struct

from extproc.envoy_lua import METADATA_NAMESPACE
from extproc.service.events_http import EventsHttpServer
from extproc.service.ports import AccountedLease, AccountingPort
from extproc.sse import Usage

log = logging.getLogger("extproc.envoy_counts")

LOST_AFTER_S = 600.0
"""Silence after which an attached request whose end never came is settled: longer than any
response may stay without a chunk (`EVERY` chunks between two calls)."""
UNSURE_AFTER_S = 30.0
"""Silence after which a request attached while no access-log stream was open here, and past
its first token, is settled. Envoy keeps each access-log stream with the process it first
reached: in a rolling update the old pod keeps them through its drain while the new pod
admits, so the new pod's ends go to the old one, which knows nothing of them. Output calls
come every `EVERY` chunks, so this much silence after the first token means the response is
over (or its engine stalled that long); before the first token a request may wait in the
engine's queue, and keeps `LOST_AFTER_S`."""
SWEEP_INTERVAL_S = 30.0
ENDED_KEPT = 65_536
"""Ids of the requests that ended here most recently, kept so that a call arriving after its
request's end (the calls and the log travel on different connections) is dropped here: with
shared state it would otherwise look like a request another process admitted, and cost a
round trip to the store to find nothing."""
MAX_COUNT = 10_000_000
MAX_EVENT_BYTES = 64


class _Open:
    __slots__ = ("charged", "end_unsure", "first_seen", "heard_at", "lease")

    def __init__(self, lease: AccountedLease, now: float, end_unsure: bool) -> None:
        self.lease = lease
        self.charged = 0
        self.first_seen = False
        self.heard_at = now
        self.end_unsure = end_unsure
        """No access-log stream was open here when it attached (`UNSURE_AFTER_S`)."""


class EnvoyCounts:
    """The requests Envoy counts for us, by gateway request id, until their end."""

    def __init__(
        self,
        port: AccountingPort,
        clock: Callable[[], float] = time.monotonic,
        forwarded_at: Callable[[str], float | None] = lambda request_id: None,
        loop_lag: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._port = port
        self._clock = clock
        self._forwarded_at = forwarded_at
        self._loop_lag = loop_lag
        self._attach_delay_s = 0.0
        """From the forward to the attach call, for the last request this process admitted."""
        self._open: dict[str, _Open] = {}
        self._ended: dict[str, None] = {}
        """`ENDED_KEPT` ids that ended here, oldest first."""
        self._log_streams = 0
        """Access-log streams open to this process now."""

    def behind_s(self, forwarded_at: float | None = None) -> float:
        """How late attach calls come now (`Settlement.accounting_behind`): the last one's
        delay after its forward, or this loop's lag, the larger. A forwarded request's
        capacity waits that much past the attach grace: an attach call queued behind a
        stalled loop would otherwise find its capacity freed (the loop runs due timers, the
        grace's among them, before it reads the sockets)."""
        del forwarded_at  # both figures are about the process, not one request
        return max(self._attach_delay_s, self._loop_lag(), 0.0)

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def log_stream_opened(self) -> None:
        self._log_streams += 1

    def log_stream_closed(self) -> None:
        self._log_streams = max(0, self._log_streams - 1)

    def attach(self, request_id: str) -> None:
        self._entry(request_id)

    def first(self, request_id: str, output: int) -> None:
        entry = self._entry(request_id)
        if entry is None:
            return
        if not entry.first_seen:
            entry.first_seen = True
            entry.lease.first_byte(self._clock())
        self._charge(entry, output)

    def output(self, request_id: str, output: int, largest_gap_us: int | None = None) -> None:
        entry = self._entry(request_id)
        if entry is not None:
            self._charge(entry, output, None if not largest_gap_us else largest_gap_us / 1e6)

    def ended(
        self,
        request_id: str,
        status: int,
        upstream: str | None,
        usage: Usage | None,
        seen: int,
        first_ago: float | None = None,
    ) -> None:
        """The stream's end. `first_ago`: how long before it the first chunk passed (Envoy's
        clock), the first token's time when the `/first` call has not come (it may still be
        on its way: a response short enough for its end to overtake it)."""
        if request_id in self._ended:
            return
        self._remember_ended(request_id)
        entry = self._open.pop(request_id, None)
        lease = entry.lease if entry is not None else self._port.attach(request_id)
        if lease is None:
            return
        if status:
            lease.response_started(status, upstream)
        if first_ago is not None and (entry is None or not entry.first_seen):
            lease.first_byte(self._clock() - first_ago)
        lease.settle(usage, seen)

    def settle_silent(self) -> int:
        """Settle, with what they were told, the requests silent for `LOST_AFTER_S`, or for
        `UNSURE_AFTER_S` past their first token when their end may have gone elsewhere."""
        now = self._clock()
        cutoff, unsure_cutoff = now - LOST_AFTER_S, now - UNSURE_AFTER_S
        lost = [
            rid
            for rid, entry in self._open.items()
            if entry.heard_at < cutoff
            or (entry.end_unsure and entry.first_seen and entry.heard_at < unsure_cutoff)
        ]
        for request_id in lost:
            entry = self._open.pop(request_id)
            log.warning("no end came for request %s: settled with its count", request_id)
            entry.lease.settle(None, entry.charged)
        return len(lost)

    def _entry(self, request_id: str) -> _Open | None:
        entry = self._open.get(request_id)
        if entry is None:
            if request_id in self._ended:
                return None
            forwarded = self._forwarded_at(request_id)
            lease = self._port.attach(request_id)
            if lease is None:
                return None
            now = self._clock()
            if forwarded is not None:
                self._attach_delay_s = max(0.0, now - forwarded)
            entry = self._open[request_id] = _Open(lease, now, self._log_streams == 0)
        else:
            entry.heard_at = self._clock()
        return entry

    def _remember_ended(self, request_id: str) -> None:
        self._ended[request_id] = None
        if len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    @staticmethod
    def _charge(entry: _Open, output: int, largest_gap: float | None = None) -> None:
        if output > entry.charged:
            entry.lease.charge_output(output - entry.charged, largest_gap)
            entry.charged = output


# -- the events listener -----------------------------------------------------------------------


def _digits(text: str, most: int) -> bool:
    """ASCII digits only (`str.isdigit` takes '²', which `int` refuses), at most `most`."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


def _count(text: str) -> int | None:
    if not _digits(text, 8):
        return None
    value = int(text)
    return value if value <= MAX_COUNT else None


def count_and_gap(text: str) -> tuple[int, int | None] | None:
    """`COUNT` or `COUNT GAP_US` (a call's body); None if malformed."""
    count_text, _, gap_text = text.partition(" ")
    count = _count(count_text)
    if count is None:
        return None
    if not gap_text:
        return count, None
    if not _digits(gap_text, 12):
        return None
    return count, int(gap_text)


class EventsServer:
    """`serve --envoy-events ADDRESS`: the Lua filter's calls (HTTP/1.1, from Envoy only: keep
    it on loopback or a private network, like the gRPC port; extproc.service.events_http)."""

    def __init__(self, counts: EnvoyCounts) -> None:
        self.counts = counts
        self._http = EventsHttpServer(self._event, MAX_EVENT_BYTES)
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, address: str) -> int:
        """Listens on `address`; returns the bound port (when 0 was asked for)."""
        port = await self._http.start(address)
        self._sweeper = asyncio.create_task(self._sweep())
        return port

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._http.stop()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.counts.settle_silent()

    def _event(self, verb: str, request_id: str, body: bytes) -> int:
        """One call: 204 taken, 400 a malformed body, 404 an unknown verb."""
        if verb == "attach":
            self.counts.attach(request_id)
            return 204
        if verb == "first":
            output = _count(body.decode("ascii", "replace"))
            if output is None:
                return 400
            self.counts.first(request_id, output)
            return 204
        if verb == "output":
            parsed = count_and_gap(body.decode("ascii", "replace"))
            if parsed is None:
                return 400
            self.counts.output(request_id, *parsed)
            return 204
        return 404


# -- the access-log sink -----------------------------------------------------------------------


def _whole(fields: Struct, key: str) -> int | None:
    value = fields.fields.get(key)
    if value is None or value.WhichOneof("kind") != "number_value":
        return None
    number = value.number_value
    return int(number) if 0 <= number <= MAX_COUNT else None


class End(NamedTuple):
    """What an access-log entry says of its request's end (`EnvoyCounts.ended`'s arguments)."""

    request_id: str
    status: int
    upstream: str | None
    usage: Usage | None
    seen: int
    first_ago: float | None
    """Seconds from the first chunk to the end of the stream (Envoy's clock), if one passed."""


def _first_ago(common: AccessLogCommon, fields: Struct) -> float | None:
    value = fields.fields.get("first_us")
    if value is None or value.WhichOneof("kind") != "number_value":
        return None
    if common.HasField("duration"):
        length = common.duration
    elif common.HasField("time_to_last_downstream_tx_byte"):  # an Envoy without `duration`
        length = common.time_to_last_downstream_tx_byte
    else:
        return None
    if not common.HasField("start_time"):
        return None
    start = common.start_time.seconds * 1_000_000 + common.start_time.nanos // 1000
    end = start + length.seconds * 1_000_000 + length.nanos // 1000
    if not start <= value.number_value <= end:
        return None  # not a time of this stream
    return float(end - value.number_value) / 1e6


def end_of(entry: HTTPAccessLogEntry) -> End | None:
    """What one access-log entry says of its request's end, or None for a stream the script
    did not follow."""
    common = entry.common_properties
    fields = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
    if fields is None:
        return None
    request_id = fields.fields.get("id")
    if request_id is None or request_id.WhichOneof("kind") != "string_value":
        return None
    status = entry.response.response_code.value
    socket_address = common.upstream_remote_address.socket_address
    upstream = (
        f"{socket_address.address}:{socket_address.port_value}" if socket_address.address else None
    )
    completion = _whole(fields, "completion")
    usage = None
    if completion is not None:
        prompt = _whole(fields, "prompt") or 0
        total = _whole(fields, "total")
        usage = Usage(
            prompt, completion, total if total is not None else prompt + completion,
            _whole(fields, "cached"),
        )  # fmt: skip
    return End(
        request_id.string_value, status, upstream, usage, _whole(fields, "tokens") or 0,
        _first_ago(common, fields),
    )  # fmt: skip


class AccessLogSink(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's gRPC access log (envoy.service.accesslog.v3): each entry ends its request."""

    def __init__(self, counts: EnvoyCounts) -> None:
        self.counts = counts

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[StreamAccessLogsMessage, StreamAccessLogsResponse],
    ) -> StreamAccessLogsResponse:
        del context
        self.counts.log_stream_opened()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    end = end_of(entry)
                    if end is None:
                        continue
                    try:
                        self.counts.ended(*end)
                    except Exception:
                        log.exception("settling request %s failed", end[0])
        finally:
            self.counts.log_stream_closed()
        return StreamAccessLogsResponse()


def add_access_log_sink(server: grpc.aio.Server, counts: EnvoyCounts) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogSink(counts), server)
