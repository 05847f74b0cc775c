"""`extproc engine`: run one emulated vLLM engine until SIGINT/SIGTERM.

Every EngineProfile field can be overridden with a flag of the same name
(`--max-num-seqs 64`, `--step-base-s 0.01`, ...); the scheduler's are named as vLLM's:
`--scheduling-policy {fcfs,priority}`, `--long-prefill-token-threshold N`,
`--max-num-batched-tokens N`, `--enable-prefix-caching` / `--no-enable-prefix-caching`
(default on, as vLLM V1). On start the engine prints one line,
`engine <id> listening on http://host:port`, to stdout (useful with `--port 0`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Sequence
from typing import Any

from extproc.heap import freeze_startup_heap
from gateway_lab.engine.profiles import PROFILES, EngineProfile, get_profile
from gateway_lab.engine.server import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MODEL,
    EngineServer,
    running_engine,
)
from gateway_lab.engine.timeline import STEP_CLOCKS
from gateway_lab.engine.waiting import SCHEDULING_POLICIES

__all__ = ["add_arguments", "main", "run", "running_engine"]

DEFAULT_PROFILE = "a100-llama3-8b"
_FIELD_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}
_FIELD_CHOICES: dict[str, tuple[str, ...]] = {"scheduling_policy": SCHEDULING_POLICIES}


def _profile_fields() -> list[tuple[str, type]]:
    return [
        (f.name, _FIELD_TYPES[str(f.type)])
        for f in dataclasses.fields(EngineProfile)
        if str(f.type) in _FIELD_TYPES and f.name != "name"
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind, 0 for any (default %(default)s)"
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help="step-time profile (default %(default)s)",
    )
    parser.add_argument(
        "--engine-id", default=None, help="value of the x-engine-id header (default host:port)"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)"
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="output tokens when a request sets no max_tokens (default %(default)s)",
    )
    parser.add_argument(
        "--accept-any-model",
        action="store_true",
        help="serve any requested model name instead of answering 404 like vLLM",
    )
    parser.add_argument(
        "--step-clock",
        choices=STEP_CLOCKS,
        default="model",
        help="when a step that follows another starts: where it ended (model, default) or "
        "when the event loop wakes (wake: the emulator before 2026-12-05, to measure what "
        "the host's lag adds)",
    )
    group = parser.add_argument_group("profile overrides")
    for name, kind in _profile_fields():
        if kind is bool:
            group.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help="(default: the profile's, on for every built-in profile)",
            )
            continue
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=None,
            choices=_FIELD_CHOICES.get(name),
            metavar=None if name in _FIELD_CHOICES else kind.__name__.upper(),
        )


def build_server(args: argparse.Namespace) -> EngineServer:
    overrides: dict[str, Any] = {name: getattr(args, name, None) for name, _ in _profile_fields()}
    profile = get_profile(args.profile, **overrides)
    return EngineServer(
        profile,
        host=args.host,
        port=args.port,
        engine_id=args.engine_id,
        model=args.model,
        default_max_tokens=args.default_max_tokens,
        strict_model=not args.accept_any_model,
        step_clock=args.step_clock,
    )


async def _serve(server: EngineServer, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT or SIGTERM, or until `stop` is set when one is given."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    freeze_startup_heap()  # as vLLM's engine core does once it is up
    try:
        print(f"engine {server.engine_id} listening on {server.base_url}", flush=True)
        await stop.wait()
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    try:
        server = build_server(args)
    except ValueError as exc:
        print(f"extproc engine: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(server))
    else:
        uvloop.run(_serve(server))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="extproc engine", description="Run an emulated vLLM OpenAI-compatible engine."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
