"""The `extproc envoy lint` subcommand: its arguments, and running it."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Check an Envoy config against a policy: the ext_proc filters, their timeouts, the ext_proc
cluster, the pool routes, the body limit and path normalisation. Each finding is printed as
FILE:LINE: severity: what is wrong — the fix. Exit status: 0 no errors (notes allowed),
1 errors, 2 a file or the policy cannot be read."""


def add_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    parser.description = DESCRIPTION
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="an Envoy bootstrap (YAML or JSON), Istio EnvoyFilter / VirtualService / "
        "DestinationRule, or Envoy Gateway policies; each file is linted on its own",
    )
    parser.add_argument(
        "--policy", default=default_policy, help="the policy (default: the embedded default)"
    )
    parser.add_argument(
        "--format", choices=("text", "json"), default="text", help="json: one object, for CI"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.envoy_lint.findings import Finding
    from extproc.envoy_lint.lint import lint_file
    from extproc.envoy_lint.reference import reference
    from extproc.envoy_lint.report import UNREADABLE, exit_status, write_json, write_text
    from extproc.envoy_lint.source import UnreadableFile
    from extproc.policy import PolicyError, load_policy

    try:
        ref = reference(load_policy(args.policy))
    except PolicyError as error:
        print(f"--policy {args.policy} cannot be used:\n{error}", file=sys.stderr)
        return UNREADABLE
    findings: list[Finding] = []
    unreadable: list[str] = []
    for path in args.files:
        try:
            findings += lint_file(path, ref)
        except UnreadableFile as problem:
            unreadable.append(str(problem))
    if args.format == "json":
        write_json(findings, unreadable, sys.stdout)
    else:
        write_text(findings, unreadable, sys.stdout, sys.stderr)
    return exit_status(findings, unreadable)
