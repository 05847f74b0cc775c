"""Domain errors and their single mapping to HTTP answers with an OpenAI-style JSON body."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from extproc.types import Outcome


@dataclass
class GatewayError(Exception):
    """A request the gateway answers itself instead of forwarding it upstream."""

    outcome: Outcome
    status: int
    message: str
    code: str
    retry_after_s: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def http_answer(error: GatewayError) -> HttpAnswer:
    """The one place a domain error becomes status, headers and body."""
    body = orjson.dumps(
        {
            "error": {
                "message": error.message,
                "type": _ERROR_TYPE.get(error.status, "api_error"),
                "code": error.code,
                "param": None,
            }
        }
    )
    headers = [("content-type", "application/json")]
    if error.retry_after_s is not None:
        headers.append(("retry-after", str(error.retry_after_s)))
    headers.extend(error.headers.items())
    return HttpAnswer(error.status, tuple(headers), body)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(Outcome.UNAUTHORIZED, 401, message, "invalid_api_key")


def bad_request(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(Outcome.BAD_REQUEST, 400, message, code)


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        Outcome.BAD_REQUEST,
        413,
        f"request body exceeds the limit of {limit} bytes",
        "body_too_large",
    )


def not_found(message: str) -> GatewayError:
    return GatewayError(Outcome.BAD_REQUEST, 404, message, "not_found")


def endpoint_not_served(endpoint: str) -> GatewayError:
    """No pool of the policy serves this endpoint class (`Pool.serves`)."""
    return GatewayError(
        Outcome.BAD_REQUEST,
        404,
        f"this gateway has no model serving {endpoint} requests",
        "endpoint_not_served",
    )


def method_not_allowed(path: str, allowed: str) -> GatewayError:
    return GatewayError(
        Outcome.BAD_REQUEST,
        405,
        f"{path} accepts {allowed} only",
        "method_not_allowed",
        headers={"allow": allowed},
    )


def never_fits_rate_limit(tenant: str, budget: int, setting: str, capacity: int) -> GatewayError:
    """A budget above a whole token bucket of the tenant (`setting` sizes it: its burst, or
    its per-minute limit): no wait makes it pass, so it is the request that is wrong (400),
    not the moment (429)."""
    return bad_request(
        f"request needs {budget} tokens (prompt + max_tokens) but tenant {tenant!r} has "
        f"{setting} {capacity}: it can never pass; lower max_tokens or shorten the prompt",
        "budget_exceeds_rate_limit",
    )


def overloaded(tenant: str, retry_after_s: int) -> GatewayError:
    """The service fell behind and sheds the tenants above their fair share first: the same
    answer as a queued request shed for it (extproc.scheduler.shares.shed_queued)."""
    return GatewayError(
        Outcome.SHED_OVERLOAD,
        429,
        f"the gateway is overloaded and tenant {tenant!r} is above its fair share; "
        f"retry after {retry_after_s}s",
        Outcome.SHED_OVERLOAD.value,
        retry_after_s=retry_after_s,
    )


def misconfigured(message: str) -> GatewayError:
    """Envoy is set up so that the service cannot admit safely (extproc envoy lint says how)."""
    return GatewayError(Outcome.UNAVAILABLE, 500, message, "gateway_misconfigured")


def shutting_down(retry_after_s: int) -> GatewayError:
    """The service is draining: the same answer as a request still queued when the drain began
    (extproc.scheduler.core.Scheduler.reject_all_queued)."""
    return GatewayError(
        Outcome.UNAVAILABLE,
        503,
        "the gateway is shutting down; retry on another replica",
        Outcome.UNAVAILABLE.value,
        retry_after_s=retry_after_s,
    )
