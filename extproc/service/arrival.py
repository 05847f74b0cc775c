"""When Envoy received a request, and how late its first message reached our handler.

The admission filter asks Envoy for the `request.time` attribute (extproc.envoy_config): the
request-headers message then carries the moment Envoy received the request's first byte, as an
RFC 3339 string on Envoy's wall clock. Compared with ours when the message is handled, it
measures what no timer in this process can see: a new stream that waited in Envoy, in the
kernel or in grpc-core before the servicer was handed it (docs/benchmarks.md, "The gateway
overloaded itself"). A loop-lag monitor and the age of the streams we hold both start counting
only once the stream has reached us.

Envoy may run on another host, whose clock differs from ours. `ArrivalDelay` therefore judges
each delay against the smallest one seen (a baseline that holds the skew plus the unavoidable
path), and lets that baseline creep up by BASELINE_DRIFT_PER_S so a clock step or a slow
slew is absorbed while a stall of seconds still shows.
"""

from __future__ import annotations

import math
from datetime import datetime

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""The key Envoy files the ext_proc filter's attributes under in `ProcessingRequest`."""
REQUEST_TIME_ATTRIBUTE = "request.time"

BASELINE_DRIFT_PER_S = 0.001
"""How fast the baseline may rise (seconds per second): a 1 ms/s creep absorbs a changed clock
offset in minutes, while a stall of a second stays a second over it for a long overload."""


def envoy_received_at(request: ProcessingRequest) -> float | None:
    """Envoy's `request.time` of this message as epoch seconds, or None if absent or not
    understood (an older Envoy, a deployment that does not ask for it)."""
    attributes = request.attributes
    if EXT_PROC_ATTRIBUTES not in attributes:
        return None
    fields = attributes[EXT_PROC_ATTRIBUTES].fields
    if REQUEST_TIME_ATTRIBUTE not in fields:
        return None
    text = fields[REQUEST_TIME_ATTRIBUTE].string_value
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None  # not a moment we can place
    return moment.timestamp()


class ArrivalDelay:
    """Envoy's receipt -> our handler, as measured and as excess over the baseline."""

    __slots__ = ("_baseline", "_seen_at")

    def __init__(self) -> None:
        self._baseline = math.inf
        self._seen_at = 0.0

    def excess(self, delay_s: float, now: float) -> float:
        """`delay_s` (our clock minus Envoy's) above the baseline; updates the baseline."""
        if math.isinf(self._baseline):
            self._baseline = delay_s
        else:
            crept = self._baseline + BASELINE_DRIFT_PER_S * max(0.0, now - self._seen_at)
            self._baseline = min(crept, delay_s)
        self._seen_at = now
        return delay_s - self._baseline
