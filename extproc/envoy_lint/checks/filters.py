"""Checks 1 and 7: the two ext_proc filters, their order, modes and failure modes."""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, missing, note
from extproc.envoy_lint.model import ExtProc, HttpFilter, Role, Setting, View
from extproc.envoy_lint.reference import Reference
from extproc.envoy_lua import COUNTING_FILTER
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA

# Envoy's defaults when processing_mode leaves a field out.
_DEFAULT_MODES = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "request_body_mode": "NONE",
    "response_body_mode": "NONE",
}
_EXPECTED_MODES: dict[Role, dict[str, str]] = {
    "admission": {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
    },
    "accounting": {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "STREAMED",
    },
}
# The service ends the admission stream once the request is forwarded, so Envoy never sends
# it the response headers either way (the render says SKIP).
_ALSO_FINE: dict[tuple[Role, str], str] = {("admission", "response_header_mode"): "SEND"}
_WHY: dict[str, str] = {
    "request_body_mode": "the admission filter estimates the budget from the whole body",
    "response_body_mode": "the accounting filter counts tokens from the streamed response",
}


def _of_role(view: View, role: Role) -> list[ExtProc]:
    return [f for f in view.ext_procs if f.role == role]


_WHAT: dict[Role, str] = {
    "admission": "synchronous, BUFFERED request body, or STREAMED sent without waiting",
    "accounting": f"observability_mode: true, {ROLE_METADATA}: {ACCOUNTING_ROLE}",
}


def _counting(view: View) -> list[HttpFilter]:
    """Envoy's own counting filter (extproc.envoy_lua): it does the accounting filter's job."""
    return [f for f in view.filters or [] if f.name == COUNTING_FILTER]


def _presence(view: View) -> list[Issue]:
    issues = []
    counting = _counting(view)
    if counting and _of_role(view, "accounting"):
        issues.append(
            error(
                counting[0].line,
                f"both {COUNTING_FILTER} and an accounting ext_proc filter: each settles every "
                "request, so its tokens are counted twice",
                "keep one (`extproc envoy render --count-in-envoy` renders the counting one)",
            )
        )
    for role, what in _WHAT.items():
        found = _of_role(view, role)
        if not found and not (role == "accounting" and counting):
            issues.append(
                missing(
                    view.complete,
                    view.line,
                    f"no {role} ext_proc filter" + ("" if view.complete else " in this file"),
                    f"add extproc.{role} ({what}) before the router",
                )
            )
        for extra in found[1:]:
            issues.append(
                error(extra.line, f"a second {role} ext_proc filter ({extra.name})", "keep one")
            )
    return issues


def _order(view: View) -> list[Issue]:
    if view.filters is None:
        if not view.ext_procs:
            return []  # the presence check has said so
        return [
            note(
                view.line,
                "this file does not show the order of the HTTP filters",
                "check that extproc.admission, then extproc.accounting, come just before the "
                "router",
            )
        ]
    names = [f.name for f in view.filters]
    routers = [i for i, f in enumerate(view.filters) if f.is_router]
    issues = []
    if not routers:
        issues.append(
            missing(
                view.complete, view.line, "no router in the HTTP filters", "end with the router"
            )
        )
    positions = {id(f.ext_proc): i for i, f in enumerate(view.filters) if f.ext_proc is not None}
    for filter_ in view.ext_procs:
        position = positions.get(id(filter_))
        if position is not None and routers and position > routers[0]:
            issues.append(
                error(
                    filter_.line,
                    f"{filter_.name} comes after the router, so it never runs",
                    "move it before envoy.filters.http.router",
                )
            )
    admission, accounting = _of_role(view, "admission"), _of_role(view, "accounting")
    counting = _counting(view)
    if admission and counting:
        first = positions.get(id(admission[0]))
        if first is not None and view.filters.index(counting[0]) < first:
            issues.append(
                error(
                    counting[0].line,
                    f"{COUNTING_FILTER} comes before {names[first]}: it finds its request by the "
                    "x-gateway-request-id header that the admission filter sets",
                    "put the admission filter first",
                )
            )
    if admission and accounting:
        first, second = positions.get(id(admission[0])), positions.get(id(accounting[0]))
        if first is not None and second is not None and second < first:
            issues.append(
                error(
                    accounting[0].line,
                    f"{accounting[0].name} comes before {names[first]}: it finds its request "
                    "by the x-gateway-request-id header that the admission filter sets",
                    "put the admission filter first",
                )
            )
    return issues


def _mode(filter_: ExtProc, field: str) -> tuple[str, int]:
    setting: Setting[str] | None = getattr(filter_, field)
    if setting is None:
        return _DEFAULT_MODES[field], filter_.line
    value = "SEND" if setting.value == "DEFAULT" else setting.value
    return value, setting.line


def _modes(filter_: ExtProc) -> list[Issue]:
    issues = []
    for field, expected in _EXPECTED_MODES[filter_.role].items():
        value, line = _mode(filter_, field)
        if value in (expected, _ALSO_FINE.get((filter_.role, field))):
            continue
        why = _WHY.get(field, f"the {filter_.role} filter needs it")
        fix = f"set {field}: {expected}"
        if filter_.role == "admission" and field == "request_body_mode" and value == "STREAMED":
            flag = filter_.send_body_without_waiting
            if flag is not None and flag.value:
                continue  # one round trip: the service has the whole body before it answers
            why = (
                "without send_body_without_waiting_for_header_response: true, the request goes "
                "upstream on the headers reply, before the service has its body"
            )
            fix += " or send_body_without_waiting_for_header_response: true"
        issues.append(
            error(line, f"{filter_.name}: processing_mode.{field} is {value}: {why}", fix)
        )
    return issues


def _accounting_settings(filter_: ExtProc) -> list[Issue]:
    issues = []
    observability = filter_.observability_mode
    if observability is None or not observability.value:
        issues.append(
            error(
                observability.line if observability else filter_.line,
                f"{filter_.name} is not in observability mode: every response chunk waits for "
                "the service",
                "set observability_mode: true",
            )
        )
    metadata = filter_.role_metadata
    if metadata is None or metadata.value != ACCOUNTING_ROLE:
        issues.append(
            error(
                metadata.line if metadata else filter_.line,
                f"{filter_.name} does not name its role: the service takes its stream for an "
                "admission stream",
                f"add grpc_service.initial_metadata {ROLE_METADATA}: {ACCOUNTING_ROLE}",
            )
        )
    return issues


def check_order_and_modes(view: View, _: Reference) -> list[Issue]:
    issues = _presence(view) + _order(view)
    for filter_ in view.ext_procs:
        issues += _modes(filter_)
        if filter_.role == "accounting":
            issues += _accounting_settings(filter_)
    return issues


def check_failure_mode(view: View, _: Reference) -> list[Issue]:
    issues = []
    for filter_ in view.ext_procs:
        setting = filter_.failure_mode_allow
        allowed = setting.value if setting is not None else False
        line = setting.line if setting is not None else filter_.line
        if filter_.role == "admission" and allowed:
            issues.append(
                error(
                    line,
                    f"{filter_.name} fails open: when the service is down, requests skip "
                    "admission (no limits, no tenant check)",
                    "set failure_mode_allow: false",
                )
            )
        if filter_.role == "accounting" and not allowed:
            issues.append(
                error(
                    line,
                    f"{filter_.name} fails closed: a hiccup of the service cuts responses that "
                    "were already admitted",
                    "set failure_mode_allow: true",
                )
            )
    return issues
