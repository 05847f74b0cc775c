"""Check 8: the listener's buffer limit, which caps the buffered request body."""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, note
from extproc.envoy_lint.model import View
from extproc.envoy_lint.reference import Reference
from extproc.envoy_lint.values import format_bytes


def check_body_limit(view: View, ref: Reference) -> list[Issue]:
    wanted = format_bytes(ref.max_body_bytes)
    field = view.name_of("per_connection_buffer_limit_bytes")
    if not view.buffer_limit_shown:
        return [
            note(
                view.line,
                f"this file does not set {field} "
                f"(default {format_bytes(view.default_buffer_limit)})",
                f"make sure it is >= {wanted}, the policy's gateway.max_body_bytes",
            )
        ]
    limit = view.buffer_limit
    value = limit.value if limit else view.default_buffer_limit
    if value >= ref.max_body_bytes:
        return []
    return [
        error(
            limit.line if limit else (view.listener_line or view.line),
            f"{field} is {format_bytes(value)}"
            + ("" if limit else ", the default")
            + f": bodies above it get 413 before admission, the policy allows {wanted}",
            f"set {field} to {ref.max_body_bytes}",
        )
    ]
