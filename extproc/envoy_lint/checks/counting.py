"""Check 10: with counting in Envoy, each response's end must reach the service at once."""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, missing, note
from extproc.envoy_lint.model import View
from extproc.envoy_lint.reference import Reference
from extproc.envoy_lua import ACCESS_LOG_NAME, COUNTING_FILTER
from extproc.service.envoy_counts import LOST_AFTER_S, UNSURE_AFTER_S

_LOG = "envoy.access_loggers.http_grpc"
_FIX = (
    f"add {_LOG} (log_name {ACCESS_LOG_NAME}, common_config.buffer_size_bytes: 0) to the "
    "connection manager's access_log, to the service's gRPC port (`extproc envoy render "
    "--count-in-envoy` renders it)"
)


def check_counting_log(view: View, _: Reference) -> list[Issue]:
    counting = [f for f in view.filters or [] if f.name == COUNTING_FILTER]
    if not counting:
        return []
    line = counting[0].line
    if view.grpc_logs is None:
        return [
            note(
                line,
                "this file does not show the connection manager's access logs: "
                f"{COUNTING_FILTER} needs a gRPC access log to the service",
                f"make sure there is one: {_FIX}",
            )
        ]
    if not view.grpc_logs:
        return [
            missing(
                view.complete,
                line,
                f"{COUNTING_FILTER} without a gRPC access log: no response's end reaches the "
                "service, so each request holds its capacity until it is settled as lost "
                f"({UNSURE_AFTER_S:.0f} s after its last call once past its first token, else "
                f"{LOST_AFTER_S / 60:.0f} minutes), with the count it was last told",
                _FIX,
            )
        ]
    if any(log.buffer_size is not None and log.buffer_size.value == 0 for log in view.grpc_logs):
        return []
    first = view.grpc_logs[0]
    size = first.buffer_size
    return [
        error(
            size.line if size is not None else first.line,
            "the gRPC access log buffers its entries ("
            + (f"{size.value} bytes" if size is not None else "16 KiB by default")
            + ", flushed every second by default): a finished request's capacity comes back "
            "only when the buffer is sent",
            "set common_config.buffer_size_bytes: 0",
        )
    ]
