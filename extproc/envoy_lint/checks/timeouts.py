"""Checks 2, 3 and 4: the timeouts that cut a held request or a long streamed response."""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, note
from extproc.envoy_lint.model import ExtProc, View
from extproc.envoy_lint.reference import (
    ENVOY_MESSAGE_TIMEOUT,
    ENVOY_ROUTE_TIMEOUT,
    ENVOY_STREAM_IDLE_TIMEOUT,
    Reference,
)
from extproc.envoy_lint.values import format_seconds as s


def _held(filter_: ExtProc, ref: Reference) -> list[Issue]:
    """Where overrides work: a short message_timeout, a max_message_timeout above the hold."""
    issues = []
    limit = filter_.max_message_timeout
    if limit is None or limit.value < ref.hold:
        issues.append(
            error(
                limit.line if limit else filter_.line,
                f"{filter_.name}: max_message_timeout is "
                + (s(limit.value) if limit else "not set")
                + f": Envoy ignores the service's override_message_timeout above it, so a "
                f"request held up to {s(ref.longest_wait)} gets an error",
                f"set max_message_timeout: {s(ref.hold)} (longest max_queue_wait + 30 s)",
            )
        )
    message = filter_.message_timeout
    value = message.value if message else ENVOY_MESSAGE_TIMEOUT
    if value < ref.message_timeout:
        issues.append(
            error(
                message.line if message else filter_.line,
                f"{filter_.name}: message_timeout is {s(value)}"
                + ("" if message else " (Envoy's default)")
                + ": the service's hold reply must arrive within it, even during a burst",
                f"set message_timeout: {s(ref.message_timeout)} (the policy's "
                "gateway.message_timeout)",
            )
        )
    return issues


def _whole_hold(filter_: ExtProc, ref: Reference) -> list[Issue]:
    """Without max_message_timeout (Envoy Gateway), messageTimeout itself must last the hold."""
    message = filter_.message_timeout
    value = message.value if message else ENVOY_MESSAGE_TIMEOUT
    if value >= ref.hold:
        return []
    return [
        error(
            message.line if message else filter_.line,
            f"{filter_.name}: messageTimeout is {s(value)}: this API cannot set "
            "max_message_timeout, so Envoy ignores the service's overrides and cuts any hold "
            "longer than messageTimeout",
            f"set messageTimeout: {s(ref.hold)} (longest max_queue_wait + 30 s)",
        )
    ]


def check_message_timeouts(view: View, ref: Reference) -> list[Issue]:
    issues = []
    for filter_ in view.ext_procs:
        if filter_.role != "admission":
            continue
        if filter_.max_message_timeout_settable:
            issues += _held(filter_, ref)
        else:
            issues += _whole_hold(filter_, ref)
        stream = filter_.grpc_timeout
        if stream is not None and 0 < stream.value < ref.hold:
            issues.append(
                error(
                    stream.line,
                    f"{filter_.name}: grpc_service.timeout {s(stream.value)} ends the gRPC "
                    "stream before the longest hold",
                    f"set grpc_service.timeout: {s(ref.hold)}",
                )
            )
    return issues


def check_stream_idle_timeout(view: View, ref: Reference) -> list[Issue]:
    manager = view.manager
    setting = manager.stream_idle_timeout if manager else None
    if setting is None and not view.complete:
        return [
            note(
                manager.line if manager else view.line,
                "this file does not set stream_idle_timeout: Envoy's default (5 min) cuts "
                f"holds longer than that; the policy holds up to {s(ref.longest_wait)}",
                f"make sure the HTTP connection manager has stream_idle_timeout >= {s(ref.idle)}",
            )
        ]
    value = setting.value if setting else ENVOY_STREAM_IDLE_TIMEOUT
    if value == 0 or value >= ref.idle:
        return []
    line = setting.line if setting else (manager.line if manager else view.line)
    return [
        error(
            line,
            f"stream_idle_timeout is {s(value)}"
            + ("" if setting else " (Envoy's default)")
            + f": a held request is an idle stream, and the policy holds up to "
            f"{s(ref.longest_wait)}",
            f"set stream_idle_timeout: {s(ref.idle)} (longest max_queue_wait + 60 s)",
        )
    ]


def check_route_timeouts(view: View, _: Reference) -> list[Issue]:
    issues: list[Issue] = []
    # Routes the file does not show are the pool-routes check's note.
    for route in view.routes or []:
        if not route.forwards:
            continue
        value = route.timeout.value if route.timeout else ENVOY_ROUTE_TIMEOUT
        if value != 0:
            issues.append(
                error(
                    route.timeout.line if route.timeout else route.line,
                    f"route timeout is {s(value)}"
                    + ("" if route.timeout else " (Envoy's default)")
                    + ": it cuts streamed responses that last longer",
                    "set timeout: 0s on the route",
                )
            )
    return issues
