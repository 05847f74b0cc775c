"""What a file shows of the gateway's pipeline, whatever its kind; the checks read only this.

A whole bootstrap shows everything, and what it leaves out takes Envoy's default. A patch
(Istio EnvoyFilter, Envoy Gateway policies) shows only what it sets: a piece it does not
show is `None`, and the checks report it as a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Role = Literal["admission", "accounting"]


@dataclass(frozen=True)
class Setting(Generic[T]):
    value: T
    line: int


@dataclass(frozen=True)
class ExtProc:
    """One ext_proc filter's settings; an absent field takes Envoy's default."""

    name: str
    line: int
    role: Role
    request_header_mode: Setting[str] | None = None
    request_body_mode: Setting[str] | None = None
    response_header_mode: Setting[str] | None = None
    response_body_mode: Setting[str] | None = None
    send_body_without_waiting: Setting[bool] | None = None
    """`send_body_without_waiting_for_header_response` (one round trip with a STREAMED body)."""
    observability_mode: Setting[bool] | None = None
    failure_mode_allow: Setting[bool] | None = None
    message_timeout: Setting[float] | None = None
    max_message_timeout: Setting[float] | None = None
    grpc_timeout: Setting[float] | None = None
    role_metadata: Setting[str] | None = None
    cluster: Setting[str] | None = None
    """The envoy_grpc cluster; None for google_grpc or a backend the file does not name."""
    max_message_timeout_settable: bool = True
    """False where the API has no such field (Envoy Gateway's EnvoyExtensionPolicy)."""


@dataclass(frozen=True)
class GrpcLog:
    """A gRPC access log (`envoy.access_loggers.http_grpc`): with counting in Envoy, each
    response's end and count reach the service on it."""

    line: int
    buffer_size: Setting[int] | None
    """`common_config.buffer_size_bytes`; None: Envoy's default, 16 KiB (entries wait up to
    `buffer_flush_interval`, 1 s by default)."""


@dataclass(frozen=True)
class HttpFilter:
    name: str
    line: int
    ext_proc: ExtProc | None = None
    disabled: Setting[bool] | None = None
    """`disabled: true` runs the filter only on routes that turn it on."""

    @property
    def is_router(self) -> bool:
        return self.name in ("envoy.filters.http.router", "router")


@dataclass(frozen=True)
class Route:
    line: int
    pool: str | None
    """The exact value the route matches on the pool header; None for any other route."""
    catch_all: bool
    """Matches every request (no header or query matcher, prefix "/" or no path matcher)."""
    timeout: Setting[float] | None
    forwards: bool
    """Sends to a cluster (not a redirect or direct response)."""
    disabled_filters: tuple[Setting[str], ...] = ()
    """Filters the route (or its virtual host) turns off by name."""
    enabled_filters: tuple[str, ...] = ()
    """Filters the route (or its virtual host) configures without turning them off: this turns
    on a filter that is disabled by default."""


@dataclass(frozen=True)
class Manager:
    """The HTTP connection manager's settings this check cares about."""

    line: int
    stream_idle_timeout: Setting[float] | None = None
    normalize_path: Setting[bool] | None = None
    merge_slashes: Setting[bool] | None = None
    escaped_slashes_action: Setting[str] | None = None
    safe_path_defaults: bool = False
    """The platform normalises paths when these are unset (Envoy Gateway does)."""


@dataclass(frozen=True)
class Cluster:
    name: str
    line: int
    thresholds: dict[str, Setting[int]] | None
    """DEFAULT-priority circuit breakers by snake_case name; None when none are set."""
    http2: Setting[bool] | None
    keepalive_interval: Setting[float] | None = None
    http2_shown: bool = True
    """False where the protocol is decided outside the file (Istio: the Service's port name)."""


@dataclass
class View:
    """One gateway pipeline as a file shows it."""

    line: int
    """Where a finding about something the file does not show points."""
    complete: bool
    """True for a whole bootstrap: what is absent takes Envoy's default."""
    filters: list[HttpFilter] | None = None
    """The HTTP filter chain in order; None when the file does not show the order."""
    ext_procs: list[ExtProc] = field(default_factory=list)
    manager: Manager | None = None
    buffer_limit: Setting[int] | None = None
    buffer_limit_shown: bool = False
    """The file shows the listener (or its client policy), so an absent limit is the default."""
    default_buffer_limit: int = 1 << 20
    """The platform's limit when none is set: Envoy's 1 MiB."""
    listener_line: int | None = None
    """Where an absent buffer limit points, when the file shows the listener."""
    spelling: dict[str, str] = field(default_factory=dict)
    """How the kind's API spells an Envoy setting, where it differs (for the fixes)."""

    def name_of(self, setting: str) -> str:
        return self.spelling.get(setting, setting)

    routes: list[Route] | None = None
    clusters: dict[str, Cluster] = field(default_factory=dict)
    clusters_shown: bool = False
    """The file holds the cluster definitions (a bootstrap's static_resources)."""
    implied_cluster: Cluster | None = None
    """A cluster the platform creates from the file's settings (Envoy Gateway's backend)."""
    grpc_logs: list[GrpcLog] | None = None
    """The connection manager's gRPC access logs; None when the file does not show its access
    logs (a patch that leaves them alone)."""
