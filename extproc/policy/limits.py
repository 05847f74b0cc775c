"""What each tenant's rate limits resolve to, per endpoint class, and the class limits that
can never bind (`extproc policy check`).

A tenant's own limits apply to all its requests; a `per_endpoint` block adds buckets (and a
concurrency limit) that only its class takes from, so a request passes when both hold. A
class limit above the tenant-wide limit of the same kind therefore never binds.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.policy.model import BucketLimits, PolicyFile

UNITS = ("requests", "tokens")
"""The bucket units, as the policy fields name them (`<unit>_per_minute`, `<unit>_burst`)."""


@dataclass(frozen=True)
class LimitWarning:
    field: str
    """The key it is about, as a path: tenants.NAME.limits.per_endpoint.CLASS.FIELD."""
    message: str

    def __str__(self) -> str:
        return f"{self.field}: warning: {self.message}"


def _bucket_text(limits: BucketLimits, unit: str) -> str | None:
    rate = getattr(limits, f"{unit}_per_minute")
    if rate is None:
        return None
    burst = getattr(limits, f"{unit}_burst")
    held = f"burst {burst}" if burst is not None else f"burst {rate}: a whole minute, default"
    return f"{unit} {rate}/min ({held})"


def _block_text(limits: BucketLimits) -> str:
    parts = [text for unit in UNITS if (text := _bucket_text(limits, unit)) is not None]
    if limits.max_concurrency is not None:
        parts.append(f"concurrency {limits.max_concurrency}")
    return ", ".join(parts) if parts else "no limits"


def _limited(limits: BucketLimits) -> bool:
    return limits.max_concurrency is not None or any(
        getattr(limits, f"{unit}_per_minute") is not None for unit in UNITS
    )


def describe_limits(source: PolicyFile) -> list[str]:
    """One line per tenant with a rate or concurrency limit: tenant-wide, then each class."""
    lines = []
    for name, tenant in source.tenants.items():
        limits = tenant.limits
        if not _limited(limits) and not limits.per_endpoint:
            continue
        parts = [f"every request: {_block_text(limits)}"]
        parts.extend(f"{c} also: {_block_text(b)}" for c, b in limits.per_endpoint.items())
        lines.append(f"tenant {name}: {'; '.join(parts)}")
    return lines


def limit_warnings(source: PolicyFile) -> list[LimitWarning]:
    """Class limits above the tenant-wide limit of the same kind: the tenant-wide one binds
    first, always."""
    out: list[LimitWarning] = []
    fields = [f"{unit}_{kind}" for unit in UNITS for kind in ("per_minute", "burst")]
    fields.append("max_concurrency")
    for name, tenant in source.tenants.items():
        limits = tenant.limits
        for endpoint, block in limits.per_endpoint.items():
            for field in fields:
                mine, wide = getattr(block, field), getattr(limits, field)
                if field.endswith("_burst") and wide is None:
                    wide = getattr(limits, field.replace("_burst", "_per_minute"))
                if mine is not None and wide is not None and mine > wide:
                    out.append(
                        LimitWarning(
                            f"tenants.{name}.limits.per_endpoint.{endpoint}.{field}",
                            f"{mine} is above the tenant-wide {wide}, which every {endpoint} "
                            "request also takes from: it never binds",
                        )
                    )
    return out
