"""How the scheduler's rejections read: one builder, and the rate-limit message."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduler import retry_after
from extproc.scheduler.ratelimit import TenantBucket
from extproc.scheduler.types import Rejection, Ticket
from extproc.types import Outcome


def reject(
    ticket: Ticket,
    outcome: Outcome,
    status: int,
    retry_after_s: int | None,
    message: str,
    headers: dict[str, str] | None = None,
) -> Rejection:
    return Rejection(
        request_id=ticket.request_id,
        tenant=ticket.tenant,
        outcome=outcome,
        http_status=status,
        retry_after_s=retry_after_s,
        message=message,
        headers=headers or {},
    )


def unknown_tenant(name: str) -> str:
    return f"tenant {name!r} is not in the policy"


def rate_limited(
    ticket: Ticket,
    charges: Sequence[tuple[TenantBucket, float]],
    levels: tuple[float, ...],
    wait_s: float | None,
    headers: dict[str, str],
) -> Rejection:
    """The buckets did not cover (bucket, cost) `charges`: `wait_s` None means never."""
    if wait_s is None:
        item, cost = next((b, c) for b, c in charges if c > b.bucket.capacity)
        message = (
            f"request needs {int(cost)} tokens (prompt + max_tokens) but tenant "
            f"{ticket.tenant!r} has {item.capacity_setting} {int(item.bucket.capacity)}: "
            "it can never pass; lower max_tokens or shorten the prompt"
        )
        return reject(ticket, Outcome.REJECTED_RATE, 429, None, message, headers)
    short = [
        item.rate_setting
        for (item, cost), level in zip(charges, levels, strict=True)
        if level < cost
    ]
    retry = retry_after.after_wait(wait_s)
    message = (
        f"rate limit reached for tenant {ticket.tenant!r} ({', '.join(short)}); "
        f"retry after {retry}s"
    )
    return reject(ticket, Outcome.REJECTED_RATE, 429, retry, message, headers)
