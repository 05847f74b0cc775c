"""`extproc serve`: the ext_proc gRPC service and its admin server, until signalled.

Lifecycle:
  start     admin server first (/healthz answers, /readyz 503), then the policy, then gRPC;
            /readyz turns 200 once gRPC accepts streams.
  SIGHUP    reload the policy file (also watched, and POST /v1/reload): a bad version is
            rejected with file:line errors and the last good policy stays in force.
  SIGTERM   drain: /readyz 503, the gRPC server stops accepting streams, queued requests are
  SIGINT    answered 503 + Retry-After, in-flight responses get `--drain-grace` seconds to
            finish, then exit 0. A second SIGTERM/SIGINT cuts the grace short.

Every option also reads an environment variable (EXTPROC_DRAIN_GRACE, EXTPROC_LOG_FORMAT,
EXTPROC_RELOAD_INTERVAL, EXTPROC_ADMIN_REMOTE_RELOAD, EXTPROC_WAIT_FOR_POLICY), so container
manifests can set them whatever the command line is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from extproc.admin import AdminServer
from extproc.heap import freeze_startup_heap
from extproc.metrics import Metrics
from extproc.policy import Policy, PolicyError, compile_policy, parse_policy
from extproc.reload import PolicyReloader
from extproc.scheduler import retry_after
from extproc.service.accounting_process import AccountingChild
from extproc.service.composition import compose_core, compose_reloader
from extproc.service.engine_watch import EngineWatcher
from extproc.service.envoy_counts import EnvoyCounts, EventsServer, add_access_log_sink
from extproc.service.gateway import Gateway
from extproc.service.logs import configure_logging
from extproc.service.server import start_grpc_server
from extproc.service.workers import WORKER_COUNT_ENV

log = logging.getLogger("extproc.serve")

LOG_FORMATS = ("json", "text")
_DRAIN_POLL_S = 0.05

# -- options ---------------------------------------------------------------------------------------


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected a number of seconds") from None


def _env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def _env_format() -> str:
    value = os.environ.get("EXTPROC_LOG_FORMAT", "json").strip().lower() or "json"
    if value not in LOG_FORMATS:
        raise SystemExit(f"EXTPROC_LOG_FORMAT={value!r}: expected one of {LOG_FORMATS}")
    return value


@dataclass(frozen=True)
class ServeOptions:
    policy: str
    grpc: str = "127.0.0.1:50051"
    admin: str = "127.0.0.1:9090"
    drain_grace: float = 30.0
    """Seconds in-flight responses get to finish after SIGTERM."""
    log_format: str = "json"
    reload_interval: float = 1.0
    """Seconds between checks of the policy file; 0 turns the watcher off."""
    allow_remote_reload: bool = False
    wait_for_policy: bool = False
    """Start with an invalid or missing policy file: stay unready and wait for a good one."""
    accounting_grpc: str = ""
    """Serve the accounting filter from a child process on this address (its own Envoy
    cluster: `extproc envoy render --accounting`); empty: on the gRPC address, in process."""
    envoy_events: str = ""
    """Count in Envoy: listen here for its Lua filter's calls (`extproc envoy render
    --count-in-envoy`) and take its access log on the gRPC address; empty: off."""

    @classmethod
    def from_env(cls, policy: str, grpc: str, admin: str) -> ServeOptions:
        return cls(
            policy=policy,
            grpc=grpc,
            admin=admin,
            drain_grace=_env_float("EXTPROC_DRAIN_GRACE", 30.0),
            log_format=_env_format(),
            reload_interval=_env_float("EXTPROC_RELOAD_INTERVAL", 1.0),
            allow_remote_reload=_env_bool("EXTPROC_ADMIN_REMOTE_RELOAD"),
            wait_for_policy=_env_bool("EXTPROC_WAIT_FOR_POLICY"),
            accounting_grpc=os.environ.get("EXTPROC_ACCOUNTING_GRPC", "").strip(),
            envoy_events=os.environ.get("EXTPROC_ENVOY_EVENTS", "").strip(),
        )


def add_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    """The `serve` flags; defaults come from the environment (see the module doc)."""
    env = ServeOptions.from_env(default_policy, "127.0.0.1:50051", "127.0.0.1:9090")
    parser.add_argument("--policy", default=default_policy)
    parser.add_argument("--grpc", default=env.grpc, help="gRPC listen address")
    parser.add_argument(
        "--admin", default=env.admin, help="admin HTTP address (loopback by default)"
    )
    parser.add_argument(
        "--drain-grace", type=float, default=env.drain_grace, metavar="SECONDS",
        help="after SIGTERM, how long in-flight responses may take (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=env.log_format)
    parser.add_argument(
        "--reload-interval", type=float, default=env.reload_interval, metavar="SECONDS",
        help="how often the policy file is checked for changes; 0: never (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--admin-remote-reload", action="store_true", default=env.allow_remote_reload,
        help="allow POST /v1/reload from non-loopback peers",
    )  # fmt: skip
    parser.add_argument(
        "--wait-for-policy", action="store_true", default=env.wait_for_policy,
        help="with a bad or missing policy file, stay up (unready) until it is fixed",
    )  # fmt: skip
    parser.add_argument(
        "--accounting-grpc", default=env.accounting_grpc, metavar="ADDRESS",
        help="serve the accounting filter from a child process on this address, so response "
        "chunks never delay admission (default: on --grpc, in this process)",
    )  # fmt: skip
    parser.add_argument(
        "--envoy-events", default=env.envoy_events, metavar="ADDRESS",
        help="Envoy counts response tokens (`extproc envoy render --count-in-envoy`): listen "
        "for its calls here and take its access log on --grpc",
    )  # fmt: skip


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    env = ServeOptions.from_env(args.policy, args.grpc, args.admin)
    return ServeOptions(
        policy=args.policy,
        grpc=args.grpc,
        admin=args.admin,
        drain_grace=getattr(args, "drain_grace", env.drain_grace),
        log_format=getattr(args, "log_format", env.log_format),
        reload_interval=getattr(args, "reload_interval", env.reload_interval),
        allow_remote_reload=getattr(args, "admin_remote_reload", env.allow_remote_reload),
        wait_for_policy=getattr(args, "wait_for_policy", env.wait_for_policy),
        accounting_grpc=getattr(args, "accounting_grpc", env.accounting_grpc),
        envoy_events=getattr(args, "envoy_events", env.envoy_events),
    )


# -- the service -----------------------------------------------------------------------------------


def install_event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _load_initial(path: str) -> tuple[Policy, str] | list[str]:
    """The policy and its text, or the problems (file:line each)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        return [f"{path}:1: cannot read: {exc.strerror or exc}"]
    try:
        return compile_policy(parse_policy(text, path), path), text
    except PolicyError as error:
        return [str(issue) for issue in error.issues]


def _log_policy_errors(errors: Sequence[str], message: str) -> None:
    log.error("%s: %s", message, "; ".join(errors), extra={"fields": {"errors": list(errors)}})


def drain_queued(gateway: Gateway) -> int:
    """Answer every still-queued request with 503 + Retry-After; returns how many."""
    return gateway.drain_queued(retry_after_s=retry_after.DRAINING_S)


class Service:
    """One `extproc serve` process: admin server, policy, gateway, gRPC server, signals."""

    def __init__(
        self, options: ServeOptions, metrics: Metrics | None = None, freeze_heap: bool = False
    ) -> None:
        self.options = options
        self.freeze_heap = freeze_heap
        """Freeze the start-up heap once serving (`freeze_startup_heap`): the process's own
        `serve`, not a Service started inside another program (tests)."""
        self.metrics = metrics or Metrics()
        self.gateway: Gateway | None = None
        self.engine_watch: EngineWatcher | None = None
        self._sighup_reloads: set[asyncio.Task[object]] = set()
        self.server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.accounting: AccountingChild | None = None
        self.accounting_port = 0
        self.envoy_counts: EnvoyCounts | None = None
        self.envoy_events: EventsServer | None = None
        self.envoy_events_port = 0
        self.admin_port = 0
        self.reloader: PolicyReloader | None = None
        self.admin = AdminServer(
            metrics=self.metrics, allow_remote_reload=options.allow_remote_reload
        )
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.drained = 0

    # -- signals --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        if self.stop_requested.is_set():
            log.warning("second stop signal: cutting the drain short")
            self.force_requested.set()
        else:
            self.stop_requested.set()

    def _on_sighup(self) -> None:
        if self.reloader is not None and not self.admin.draining:
            # Parsed off the event loop, like the watcher's and POST /v1/reload's reloads.
            task = asyncio.get_running_loop().create_task(self.reloader.reload_async("sighup"))
            self._sighup_reloads.add(task)
            task.add_done_callback(self._sighup_reloads.discard)
        else:
            log.warning("SIGHUP ignored: no policy loaded yet or draining")

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

    def remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)

    # -- start ----------------------------------------------------------------------------------

    async def _wait_for_policy(self) -> tuple[Policy, str] | None:
        """Poll the policy file until it is valid; None if stopped first."""
        options = self.options
        interval = options.reload_interval if options.reload_interval > 0 else 1.0
        last: list[str] | None = None
        while not self.stop_requested.is_set():
            loaded = _load_initial(options.policy)
            if not isinstance(loaded, list):
                return loaded
            if loaded != last:
                _log_policy_errors(loaded, "no valid policy yet; waiting for the file to change")
                self.metrics.reload_attempt("error")
                last = loaded
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_requested.wait(), interval)
        return None

    async def start(self) -> bool:
        """Start everything; False if the policy is invalid (and not waiting for it)."""
        options = self.options
        self.admin_port = await self.admin.start(options.admin)
        loaded = _load_initial(options.policy)
        if isinstance(loaded, list):
            if not options.wait_for_policy:
                _log_policy_errors(loaded, "invalid policy")
                return False
            waited = await self._wait_for_policy()
            if waited is None:
                return False
            loaded = waited
        policy, text = loaded
        # Worker processes of one supervisor share the engines (extproc.service.workers).
        workers = os.environ.get(WORKER_COUNT_ENV, "1").strip()
        sole_client = not workers.isdigit() or int(workers) <= 1
        core = compose_core(policy, self.metrics, sole_client)
        gateway = self.gateway = core.gateway
        reloader = compose_reloader(gateway, options.policy, self.metrics, options.reload_interval)
        self.engine_watch = EngineWatcher(
            core.capacities,
            lambda: {name: list(pool.endpoints) for name, pool in gateway.policy.pools.items()},
            core.clock,
            core.admission.pump,
            gateway.engine_poller,
        )
        # Connect the admission state store (a no-op in memory) before taking streams.
        await gateway.start()
        self.metrics.policy_tenants.set(len(policy.tenants))
        self.reloader = reloader
        self.reloader.mark_loaded(text)
        self.admin.gateway = gateway
        self.admin.reloader = self.reloader
        self.engine_watch.start()
        if options.accounting_grpc:
            self.accounting = AccountingChild(
                gateway, options.accounting_grpc, options.log_format, gateway.forwarded_at
            )
            self.accounting_port = await self.accounting.start()
            gateway.accounting_runs_behind_by(self.accounting.behind_s)
        also = None
        if options.envoy_events:
            counts = self.envoy_counts = EnvoyCounts(
                gateway, forwarded_at=gateway.forwarded_at, loop_lag=lambda: gateway.overload.lag_s
            )
            gateway.accounting_runs_behind_by(counts.behind_s)
            self.envoy_events = EventsServer(counts)
            self.envoy_events_port = await self.envoy_events.start(options.envoy_events)
            also = functools.partial(add_access_log_sink, counts=counts)
        self.server, self.grpc_port = await start_grpc_server(
            gateway, options.grpc, gateway.overload, also
        )
        self.admin.serving = True
        if self.freeze_heap:
            freeze_startup_heap()
        self.metrics.ready.set(1)
        self.reloader.start()
        host_grpc = options.grpc.rpartition(":")[0]
        host_admin = options.admin.rpartition(":")[0]
        log.info(
            "serving",
            extra={
                "fields": {
                    "grpc": f"{host_grpc}:{self.grpc_port}",
                    "accounting_grpc": self.accounting_port or None,
                    "envoy_events": self.envoy_events_port or None,
                    "admin": f"http://{host_admin}:{self.admin_port}",
                    "policy": options.policy,
                    "tenants": len(policy.tenants),
                    "pools": sorted(policy.pools),
                    "drain_grace_s": options.drain_grace,
                    "pid": os.getpid(),
                }
            },
        )
        return True

    # -- stop -----------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop taking streams, answer the queued, let in-flight responses finish."""
        self.admin.draining = True
        self.metrics.ready.set(0)
        self.metrics.draining.set(1)
        if self.reloader is not None:
            await self.reloader.stop()
        gateway, server = self.gateway, self.server
        if gateway is None or server is None:
            return
        snapshot = gateway.scheduler.snapshot()
        grace = max(0.0, self.options.drain_grace)
        log.info(
            "draining",
            extra={
                "fields": {
                    "grace_s": grace,
                    "queued": snapshot.get("queued", 0),
                    "inflight": snapshot.get("leases", 0),
                }
            },
        )
        gateway.closing = True  # a stream that reaches admission from now on gets 503
        loop = asyncio.get_running_loop()
        began = loop.time()
        # What the grace cuts is what is in flight when it runs out. Counted by a timer at
        # the deadline: it fires before the server's own (started after `began`), while
        # the cut requests still hold their leases; a poll after the cancellations count 0.
        at_deadline: list[int] = []
        deadline = loop.call_at(
            began + grace, lambda: at_deadline.append(gateway.scheduler.inflight())
        )
        self.drained += drain_queued(gateway)
        forced_cut: int | None = None
        if self.envoy_counts is not None:
            forced_cut = await self._await_envoy_counted(began + grace)
        # New RPCs are refused from here on; running ones keep going until the deadline.
        stopping = asyncio.ensure_future(
            server.stop(0.0 if forced_cut is not None else max(0.0, began + grace - loop.time()))
        )
        while not stopping.done():
            if self.force_requested.is_set():
                forced_cut = gateway.scheduler.inflight()
                await server.stop(0)
                break
            await asyncio.wait({stopping}, timeout=_DRAIN_POLL_S)
            if self._only_envoys_access_log_left():
                # Envoy's access-log stream never ends by itself: stop waiting for it.
                await server.stop(0)
                break
            # A stream that was between its headers and its body when the drain began
            # may still join the queue: answer it too.
            self.drained += drain_queued(gateway)
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
        # The accounting process's streams are the in-flight responses: let them end too.
        accounting = self.accounting
        while (
            accounting is not None
            and accounting.open_streams
            and forced_cut is None
            and loop.time() - began < grace
        ):
            await asyncio.sleep(_DRAIN_POLL_S)
            if self.force_requested.is_set():
                forced_cut = gateway.scheduler.inflight()
        deadline.cancel()
        self.drained += gateway.refused_closing
        if self.drained:
            self.metrics.drained_requests.inc(self.drained)
        cut = forced_cut if forced_cut is not None else sum(at_deadline)
        fields = {"drained_queued": self.drained, "inflight_cut": cut}
        if cut:
            log.warning("drain grace over; in-flight requests were cut", extra={"fields": fields})
        else:
            log.info("drained", extra={"fields": fields})

    async def _await_envoy_counted(self, deadline: float) -> int | None:
        """With counting in Envoy, wait until the requests in flight have ended (their ends
        come on Envoy's access-log stream, which may not be open yet: the gRPC server keeps
        taking streams meanwhile, and admission answers 503) or `deadline` passes. The
        number still in flight if a second signal cut the wait, else None."""
        gateway, loop = self.gateway, asyncio.get_running_loop()
        assert gateway is not None
        while not self._only_envoys_access_log_left() and loop.time() < deadline:
            if self.force_requested.is_set():
                return gateway.scheduler.inflight()
            await asyncio.sleep(_DRAIN_POLL_S)
            self.drained += drain_queued(gateway)
        return None

    def _only_envoys_access_log_left(self) -> bool:
        counts, gateway = self.envoy_counts, self.gateway
        return (
            counts is not None
            and gateway is not None
            and counts.open_requests == 0
            and gateway.scheduler.inflight() == 0
        )

    async def close(self) -> None:
        if self.envoy_events is not None:
            await self.envoy_events.stop()
        if self.engine_watch is not None:
            self.engine_watch.stop()
        if self.reloader is not None:
            await self.reloader.stop()
        if self.server is not None and not self.admin.draining:
            await self.server.stop(0)
        if self.accounting is not None:
            await self.accounting.stop()
        if self.gateway is not None:
            await self.gateway.close()
        await self.admin.stop()

    async def run(self) -> int:
        self.install_signal_handlers()
        try:
            try:
                started = await self.start()
            except OSError as error:
                log.error("cannot start: %s", error)
                return 1
            except Exception:
                log.exception("cannot start")
                return 1
            if not started:
                return 0 if self.stop_requested.is_set() else 1
            await self.stop_requested.wait()
            await self.drain()
            return 0
        finally:
            await self.close()
            self.remove_signal_handlers()
            log.info("stopped")


async def serve(options: ServeOptions) -> int:
    return await Service(options, freeze_heap=True).run()


def run_serve(
    policy_path: str,
    grpc_address: str = "127.0.0.1:50051",
    admin_address: str = "127.0.0.1:9090",
    options: ServeOptions | None = None,
) -> int:
    """Entry point of `extproc serve`. Options not given are read from the environment."""
    if options is None:
        options = ServeOptions.from_env(policy_path, grpc_address, admin_address)
    configure_logging(options.log_format)
    install_event_loop_policy()
    return asyncio.run(serve(options))


def run(args: argparse.Namespace) -> int:
    """Run from parsed `add_arguments` flags (what `extproc serve` calls)."""
    options = options_from_args(args)
    return run_serve(options.policy, options.grpc, options.admin, options)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m extproc.service.main`: the same service, with every flag."""
    from extproc.defaults import default_policy_path

    parser = argparse.ArgumentParser(prog="extproc serve", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO")
    add_arguments(parser, default_policy_path())
    args = parser.parse_args(argv)
    configure_logging(args.log_format, str(args.log_level).upper())
    return run(args)


__all__ = [
    "ServeOptions",
    "Service",
    "add_arguments",
    "drain_queued",
    "main",
    "run",
    "run_serve",
    "serve",
]


if __name__ == "__main__":
    sys.exit(main())
