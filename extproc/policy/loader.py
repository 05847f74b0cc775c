"""Read a policy file into a validated model; every error names file, line and field."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError

from extproc.policy.hold import envoy_hold_limit, holds_over_limit
from extproc.policy.keys import is_key_hash
from extproc.policy.model import BucketLimits, Limits, PolicyFile
from extproc.policy.yaml_limits import YamlLimitError, check_yaml_limits

FieldPath = tuple[str | int, ...]


@dataclass(frozen=True)
class PolicyIssue:
    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return (
            f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        )


class PolicyError(Exception):
    """A policy file that cannot be used; `issues` lists every problem found."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


def _plain(node: Any, path: FieldPath, lines: dict[FieldPath, int]) -> Any:
    """Convert ruamel's round-trip tree into plain Python, recording 1-based lines per path."""
    if isinstance(node, CommentedMap):
        out: dict[Any, Any] = {}
        for key, value in node.items():
            child = (*path, str(key))
            lines[child] = node.lc.key(key)[0] + 1
            out[str(key) if not isinstance(key, int | float) else key] = _plain(value, child, lines)
        return out
    if isinstance(node, CommentedSeq):
        items = []
        for index, value in enumerate(node):
            child = (*path, index)
            lines[child] = node.lc.item(index)[0] + 1
            items.append(_plain(value, child, lines))
        return items
    if isinstance(node, bool) or node is None:
        return node
    for kind in (int, float, str):
        if isinstance(node, kind):
            return kind(node)
    return node


def _line_of(path: FieldPath, lines: dict[FieldPath, int]) -> int:
    for end in range(len(path), 0, -1):
        line = lines.get(path[:end])
        if line is not None:
            return line
    return 1


def _field_name(path: Iterable[str | int]) -> str:
    return ".".join(str(part) for part in path)


def semantic_issues(policy: PolicyFile) -> list[tuple[FieldPath, str]]:
    """Rules that span fields, each with the path of the field it is about."""
    found: list[tuple[FieldPath, str]] = []
    tiers = set(policy.tiers)
    if len(tiers) != len(policy.tiers):
        found.append((("tiers",), "a tier is listed twice"))
    for tier in policy.tier_options:
        if tier not in tiers:
            found.append(
                (("tier_options", tier), f"unknown tier {tier!r}; tiers are {policy.tiers}")
            )
    owner_of_key: dict[str, str] = {}
    for name, tenant in policy.tenants.items():
        if tenant.tier not in tiers:
            found.append(
                (
                    ("tenants", name, "tier"),
                    f"unknown tier {tenant.tier!r}; tiers are {policy.tiers}",
                )
            )
        for index, key in enumerate(tenant.api_keys):
            path: FieldPath = ("tenants", name, "api_keys", index)
            if not is_key_hash(key):
                found.append(
                    (path, 'must be "sha256:" and 64 hex digits (extproc policy hash-key)')
                )
            elif key in owner_of_key and owner_of_key[key] != name:
                found.append((path, f"key hash already used by tenant {owner_of_key[key]!r}"))
            elif key in owner_of_key:
                found.append((path, "key hash listed twice"))
            owner_of_key[key] = name
        found.extend(limit_issues(("tenants", name, "limits"), tenant.limits))
    if policy.priority.min > policy.priority.max:
        found.append((("priority", "min"), "must not exceed priority.max"))
    if not policy.priority.min <= policy.priority.default <= policy.priority.max:
        found.append((("priority", "default"), "must lie within [priority.min, priority.max]"))
    explicit = policy.gateway.max_message_timeout
    if explicit is not None:
        for name, hold in holds_over_limit(policy, envoy_hold_limit(policy)):
            found.append(
                (
                    ("tenants", name, "limits", "max_queue_wait"),
                    f"a hold of {hold:g}s (max_queue_wait + 5s) exceeds "
                    f"gateway.max_message_timeout {explicit:g}s",
                )
            )
    return found


def _burst_issues(path: FieldPath, limits: BucketLimits) -> list[tuple[FieldPath, str]]:
    found: list[tuple[FieldPath, str]] = []
    for unit in ("requests", "tokens"):
        rate, burst = getattr(limits, f"{unit}_per_minute"), getattr(limits, f"{unit}_burst")
        if burst is None:
            continue
        where = (*path, f"{unit}_burst")
        if rate is None:
            found.append((where, f"needs {unit}_per_minute (the rate its bucket refills at)"))
        elif burst > rate:
            found.append(
                (
                    where,
                    f"{burst} exceeds {unit}_per_minute {rate}: a bucket holding more than a "
                    "minute's limit would let more than the limit through in a minute",
                )
            )
    return found


def limit_issues(path: FieldPath, limits: Limits) -> list[tuple[FieldPath, str]]:
    """A burst needs its rate and stays within it, tenant-wide and in each class block."""
    found = _burst_issues(path, limits)
    for endpoint, block in limits.per_endpoint.items():
        found.extend(_burst_issues((*path, "per_endpoint", endpoint), block))
    return found


def parse_policy(text: str, file: str = "<policy>") -> PolicyFile:
    """Validate policy text; raise PolicyError with every issue found."""
    try:
        check_yaml_limits(text)
    except YamlLimitError as exc:
        raise PolicyError([PolicyIssue(file, exc.line, "", exc.message)]) from None
    yaml = YAML(typ="rt")
    try:
        tree = yaml.load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise PolicyError([PolicyIssue(file, line, "", f"YAML syntax: {exc.problem}")]) from None
    lines: dict[FieldPath, int] = {}
    data = _plain(tree, (), lines)
    if not isinstance(data, dict):
        raise PolicyError([PolicyIssue(file, 1, "", "the policy must be a YAML mapping")])
    try:
        policy = PolicyFile.model_validate(data)
    except pydantic.ValidationError as exc:
        issues = []
        for error in exc.errors(include_url=False):
            path = tuple(p for p in error["loc"] if isinstance(p, str | int))
            message = error["msg"].removeprefix("Value error, ")
            if path and path[-1] == "[key]":  # a mapping key that is not one of the allowed
                path = path[:-1]
                message = f"unknown key; use {message.removeprefix('Input should be ')}"
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            elif error["type"] == "missing":
                message = "required field is missing"
            issues.append(PolicyIssue(file, _line_of(path, lines), _field_name(path), message))
        raise PolicyError(issues) from None
    problems = semantic_issues(policy)
    if problems:
        raise PolicyError(
            [PolicyIssue(file, _line_of(p, lines), _field_name(p), m) for p, m in problems]
        )
    return policy


def issues_at(text: str, file: str, found: list[tuple[FieldPath, str]]) -> list[PolicyIssue]:
    """Issues about fields of a policy text that `parse_policy` accepted, each at its line."""
    lines: dict[FieldPath, int] = {}
    _plain(YAML(typ="rt").load(text), (), lines)
    return [PolicyIssue(file, _line_of(p, lines), _field_name(p), m) for p, m in found]


def load_policy_file(path: str | Path) -> PolicyFile:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([PolicyIssue(str(path), 1, "", f"cannot read: {exc.strerror}")]) from None
    return parse_policy(text, str(path))
