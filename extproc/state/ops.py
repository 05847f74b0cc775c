"""The operations of the shared-state script (extproc/state/admission.lua), one type each.

Operations are typed here and turned into the script's wire form (short keys, one JSON object
per operation) in one place, `encode`. Replies stay the script's JSON objects (`Reply`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extproc.endpoints import EndpointClass
from extproc.scheduler import Bucket, Take

Reply = dict[str, Any]
BacklogEntry = tuple[str, int, str]
"""(pool, tier rank, tenant): a tenant of this process waits for the pool."""


@dataclass(frozen=True, slots=True)
class TakeBuckets:
    """Take every bucket or none (a request's requests/tokens budgets)."""

    takes: tuple[Take, ...]


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Refund to a bucket (work taken for but never served)."""

    bucket: Bucket
    amount: float


@dataclass(frozen=True, slots=True)
class AdjustBucket:
    """Debit (or credit) a bucket: what was consumed locally during an outage."""

    bucket: Bucket
    delta: float


@dataclass(frozen=True, slots=True)
class BucketLevel:
    bucket: Bucket


@dataclass(frozen=True, slots=True)
class Gate:
    """Grant a capacity lease (pool, tenant concurrency, tier priority, fair share) or refuse."""

    request_id: str
    tenant: str
    pool: str
    tier_rank: int
    budget: int
    input_tokens: int
    max_output_tokens: int
    weight: float
    fair_cost: float
    input_weight: float
    output_weight: float
    max_concurrency: int
    """0: no limit."""
    pool_max_inflight: int
    pool_max_tokens: int
    fair_slack: float
    endpoint: EndpointClass = "chat"
    class_concurrency: int = 0
    """The max_concurrency of the request's endpoint class; 0: no limit."""
    settled_buckets: tuple[Bucket, ...] = ()
    """The token buckets the request took from (the tenant's, its class's), settled at
    release against real usage."""
    force: bool = False
    """Register the lease whatever the limits say (it is running here already)."""


@dataclass(frozen=True, slots=True)
class TakeAndGate:
    """The uncontended fast path: take the buckets and, if that passes, the lease."""

    takes: tuple[Take, ...]
    gate: Gate


@dataclass(frozen=True, slots=True)
class Release:
    """Free a lease exactly once by request id, settling against real usage when known."""

    request_id: str
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ChargeOutput:
    request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Renew:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Peek:
    pool: str


@dataclass(frozen=True, slots=True)
class Backlog:
    add: tuple[BacklogEntry, ...] = ()
    remove: tuple[BacklogEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class Attach:
    """An accounting stream of this process took over a request (maybe admitted elsewhere)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class HandOff:
    """The admission stream ended: release unless an accounting stream attached."""

    request_id: str


Op = (
    TakeBuckets
    | GiveBack
    | AdjustBucket
    | BucketLevel
    | Gate
    | TakeAndGate
    | Release
    | ChargeOutput
    | Renew
    | Peek
    | Backlog
    | Attach
    | HandOff
)


def _bucket(bucket: Bucket) -> list[object]:
    return [bucket.key, bucket.capacity, bucket.refill_per_second]


def _takes(takes: Sequence[Take]) -> list[list[object]]:
    return [[*_bucket(t.bucket), t.cost] for t in takes]


def _gate(op: Gate) -> dict[str, object]:
    wire: dict[str, object] = {
        "o": "gate", "rid": op.request_id, "t": op.tenant, "p": op.pool, "k": op.tier_rank,
        "b": op.budget, "i": op.input_tokens, "x": op.max_output_tokens, "w": op.weight,
        "c": op.fair_cost, "wi": op.input_weight, "wo": op.output_weight,
        "mc": op.max_concurrency, "pm": op.pool_max_inflight, "pt": op.pool_max_tokens,
        "f": 1 if op.force else 0, "s": op.fair_slack, "e": op.endpoint,
        "cm": op.class_concurrency,
    }  # fmt: skip
    if op.settled_buckets:
        wire["tbs"] = [_bucket(bucket) for bucket in op.settled_buckets]
    return wire


def encode(op: Op) -> dict[str, object]:
    """The script's wire form of one operation."""
    match op:
        case TakeBuckets(takes):
            return {"o": "take", "b": _takes(takes)}
        case TakeAndGate(takes, gate):
            return {**_gate(gate), "o": "tg", "bk": _takes(takes)}
        case GiveBack(bucket, amount):
            return {"o": "give", "k": bucket.key, "c": bucket.capacity,
                    "r": bucket.refill_per_second, "a": amount}  # fmt: skip
        case AdjustBucket(bucket, delta):
            return {"o": "adj", "k": bucket.key, "c": bucket.capacity,
                    "r": bucket.refill_per_second, "d": delta}  # fmt: skip
        case BucketLevel(bucket):
            return {"o": "lvl", "k": bucket.key, "c": bucket.capacity,
                    "r": bucket.refill_per_second}  # fmt: skip
        case Gate():
            return _gate(op)
        case Release(request_id, input_tokens, output_tokens):
            wire: dict[str, object] = {"o": "rel", "rid": request_id}
            if input_tokens is not None:
                wire["ai"] = input_tokens
            if output_tokens is not None:
                wire["ao"] = output_tokens
            return wire
        case ChargeOutput(request_id, tokens):
            return {"o": "chg", "rid": request_id, "n": tokens}
        case Renew(request_ids):
            return {"o": "renew", "rids": list(request_ids)}
        case Peek(pool):
            return {"o": "peek", "p": pool}
        case Backlog(add, remove):
            return {"o": "bl", "add": [list(a) for a in add], "rm": [list(r) for r in remove]}
        case Attach(request_id):
            return {"o": "att", "rid": request_id}
        case HandOff(request_id):
            return {"o": "hand", "rid": request_id}
    raise TypeError(f"not a state operation: {op!r}")


def reply_list(value: object) -> list[object]:
    """cjson encodes an empty Lua table as {}: read it as an empty list."""
    return value if isinstance(value, list) else []
