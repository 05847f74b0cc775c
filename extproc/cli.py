"""The `extproc` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path

from extproc.defaults import default_policy_path

DEFAULT_POLICY = default_policy_path()
# Other packages add subcommands here (the lab adds up, engine, bench, simulate): each entry
# point is a callable(subparsers, default_policy) that adds its parsers with a `func` default.
COMMAND_GROUP = "extproc.commands"


def _policy_check(args: argparse.Namespace) -> int:
    from extproc.policy import PolicyError, load_policy
    from extproc.policy.capacity import (
        capacity_warnings,
        describe_endpoints,
        describe_isolation,
        describe_overload,
        describe_pools,
    )
    from extproc.policy.limits import describe_limits, limit_warnings

    failed = False
    for file in args.files:
        try:
            policy = load_policy(file)
        except PolicyError as error:
            failed = True
            for issue in error.issues:
                print(issue, file=sys.stderr)
            continue
        print(f"{file}: ok ({len(policy.tenants)} tenants, {len(policy.pools)} pools)")
        for line in [
            *describe_pools(policy.source),
            *describe_limits(policy.source),
            *describe_isolation(policy.source),
            *describe_endpoints(policy.source),
            *describe_overload(policy.source),
        ]:
            print(f"  {line}")
        for warning in [*capacity_warnings(policy.source), *limit_warnings(policy.source)]:
            print(f"{file}: {warning}", file=sys.stderr)
    return 1 if failed else 0


def _policy_hash_key(_: argparse.Namespace) -> int:
    from extproc.policy import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("hash-key: no key on stdin", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def _policy_schema(_: argparse.Namespace) -> int:
    from extproc.policy import PolicyFile

    schema = PolicyFile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "extproc policy"
    print(json.dumps(schema, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.workers > 1:
        from extproc.service.workers import run_workers

        return run_workers(args)
    from extproc.service.main import run

    return run(args)


def _envoy_render(args: argparse.Namespace) -> int:
    from extproc.envoy_config import RenderOptions, render_bootstrap
    from extproc.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(error, file=sys.stderr)
        return 1
    overrides: dict[str, list[str]] = {}
    for item in args.pool_endpoint or []:
        pool, _, endpoint = item.partition("=")
        if pool not in policy.pools or not endpoint:
            print(
                f"--pool-endpoint {item!r}: expected POOL=HOST:PORT with a known pool",
                file=sys.stderr,
            )
            return 1
        overrides.setdefault(pool, []).append(endpoint)
    options = RenderOptions(
        listen=args.listen,
        extproc=args.extproc,
        accounting=args.accounting or None,
        admin=args.envoy_admin,
        pool_endpoints=overrides,
        envoy_events=args.count_in_envoy or None,
        extproc_health=args.extproc_health or None,
        one_round_trip=args.one_round_trip,
    )
    try:
        text = render_bootstrap(policy, options)
    except ValueError as error:  # e.g. events and ext_proc addresses that do not pair up
        print(f"extproc envoy render: {error}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    policy = commands.add_parser("policy", help="check and author policy files")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_commands.add_parser("check", help="validate policy files")
    check.add_argument("files", nargs="+")
    check.set_defaults(func=_policy_check)
    policy_commands.add_parser(
        "hash-key", help='read an API key on stdin, print its "sha256:" form'
    ).set_defaults(func=_policy_hash_key)
    policy_commands.add_parser("schema", help="print the JSON Schema").set_defaults(
        func=_policy_schema
    )

    serve = commands.add_parser("serve", help="run the ext_proc gRPC service")
    from extproc.service.main import add_arguments as add_serve_arguments

    add_serve_arguments(serve, DEFAULT_POLICY)
    from extproc.service.workers import add_arguments as add_worker_arguments

    add_worker_arguments(serve)
    serve.set_defaults(func=_serve)

    envoy = commands.add_parser("envoy", help="Envoy configuration")
    envoy_commands = envoy.add_subparsers(dest="envoy_command", required=True)
    render = envoy_commands.add_parser("render", help="print an Envoy bootstrap for a policy")
    render.add_argument("--policy", default=DEFAULT_POLICY)
    render.add_argument("--listen", default="127.0.0.1:8080")
    render.add_argument("--extproc", default="127.0.0.1:50051")
    render.add_argument(
        "--accounting", default="", metavar="HOST:PORT",
        help="the accounting filter's own cluster (`serve --accounting-grpc`); default: --extproc",
    )  # fmt: skip
    render.add_argument(
        "--extproc-health", default="", metavar="HOST:PORT[,...]",
        help="the admin address of each --extproc address, same order: Envoy asks its /healthz "
        "every second and sends no new stream to a process that stops answering",
    )  # fmt: skip
    render.add_argument(
        "--count-in-envoy", default="", metavar="HOST:PORT",
        help="count response tokens in Envoy (Lua) and send the service's `serve "
        "--envoy-events` listener at this address what it needs, instead of every chunk "
        "(docs/deploy.md, \"Counting in Envoy\"); with workers on distinct ports, one per "
        "worker, comma-separated in the order of --extproc's",
    )  # fmt: skip
    render.add_argument(
        "--one-round-trip", action="store_true",
        help="the admission filter streams the body without waiting for the headers reply, "
        "so Envoy waits on the service once per request instead of twice; a client pausing "
        "mid-body longer than the message timeout is then cut (docs/deploy.md)",
    )  # fmt: skip
    render.add_argument("--envoy-admin", default="127.0.0.1:9901")
    render.add_argument(
        "--pool-endpoint", action="append", help="POOL=HOST:PORT, replaces the policy's endpoints"
    )
    render.add_argument("-o", "--output")
    render.set_defaults(func=_envoy_render)

    from extproc.envoy_lint.command import add_arguments as add_lint_arguments

    add_lint_arguments(
        envoy_commands.add_parser("lint", help="check an Envoy config against a policy"),
        DEFAULT_POLICY,
    )

    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        entry.load()(commands, DEFAULT_POLICY)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(message)s" if args.command == "serve" else "%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
