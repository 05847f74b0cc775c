"""The pure admission scheduler core: rate limits -> tier -> fair share -> tenant order.

No asyncio, no I/O, no wall clock: the live service and the offline simulator drive the same
`Scheduler` through an injected `Clock`.
"""

from extproc.scheduler.capacity import Capacity, StaticCapacity
from extproc.scheduler.clock import Clock, ManualClock, MonotonicClock
from extproc.scheduler.core import Scheduler
from extproc.scheduler.fairness import (
    FAIRNESS_POLICIES,
    DeficitRoundRobin,
    FairnessPolicy,
    VirtualTokenCounter,
    make_fairness,
)
from extproc.scheduler.limits import (
    Bucket,
    LimitStore,
    MemoryLimitStore,
    Take,
    TakeResult,
    format_reset,
    ratelimit_headers,
)
from extproc.scheduler.locality import LocalityIndex, prefix_blocks, render_prompt
from extproc.scheduler.ratelimit import DIMENSIONS, LimitDimension
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.types import Admission, Lease, Rejection, Ticket

__all__ = [
    "DIMENSIONS",
    "FAIRNESS_POLICIES",
    "Admission",
    "Bucket",
    "Capacity",
    "Clock",
    "DecayingRate",
    "DeficitRoundRobin",
    "FairnessPolicy",
    "Lease",
    "LimitDimension",
    "LimitStore",
    "LocalityIndex",
    "ManualClock",
    "MemoryLimitStore",
    "MonotonicClock",
    "Rejection",
    "Scheduler",
    "StaticCapacity",
    "Take",
    "TakeResult",
    "Ticket",
    "VirtualTokenCounter",
    "format_reset",
    "make_fairness",
    "prefix_blocks",
    "ratelimit_headers",
    "render_prompt",
]
