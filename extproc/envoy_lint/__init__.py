"""`extproc envoy lint`: check an Envoy config a user already runs against a policy.

It reads an Envoy bootstrap, an Istio EnvoyFilter or Envoy Gateway policies, and reports each
trap of docs/deploy.md ("The facts that matter") with its line and fix.
"""

from __future__ import annotations

import argparse
import sys

from extproc.envoy_lint.findings import Finding
from extproc.envoy_lint.lint import lint_file
from extproc.envoy_lint.reference import reference
from extproc.envoy_lint.report import UNREADABLE, exit_status, write_json, write_text
from extproc.envoy_lint.source import UnreadableFile


def run(args: argparse.Namespace) -> int:
    """The `envoy lint` command: args.files, args.policy, args.format ("text" or "json")."""
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


__all__ = ["lint_file", "reference", "run"]
