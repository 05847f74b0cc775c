"""Bounds on policy YAML checked before it is built into objects.

YAML aliases share one node, but turning the tree into plain data expands every alias, so a
few hundred bytes of nested aliases ("billion laughs") cost minutes of CPU and gigabytes. The
event stream is linear in the text: walking it once gives the expanded size of every anchor
without expanding anything, and a file over a bound is refused before the tree is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    Event,
    NodeEvent,
)

MAX_POLICY_BYTES = 4 * 1024 * 1024
MAX_ALIASES = 10_000
MAX_EXPANDED_NODES = 250_000
MAX_DEPTH = 64
_BRACKET = re.compile(r"[\[\]{}]")


class YamlLimitError(Exception):
    def __init__(self, line: int, message: str) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}")


@dataclass
class _Open:
    anchor: str | None
    nodes: int = 1


@dataclass
class _Walk:
    sizes: dict[str, int] = field(default_factory=dict)
    stack: list[_Open] = field(default_factory=list)
    open_anchors: set[str] = field(default_factory=set)
    total: int = 0
    aliases: int = 0

    def count(self, nodes: int, line: int) -> None:
        """`nodes` more nodes in the expanded document, inside the innermost open collection."""
        self.total += nodes
        if self.total > MAX_EXPANDED_NODES:
            raise YamlLimitError(
                line, f"expands to more than {MAX_EXPANDED_NODES} nodes (aliases nest too deep)"
            )
        for collection in self.stack:
            collection.nodes += nodes

    def on_event(self, event: Event) -> None:
        line = event.start_mark.line + 1 if event.start_mark is not None else 1
        if isinstance(event, AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise YamlLimitError(line, f"more than {MAX_ALIASES} aliases")
            name = str(event.anchor)
            if name in self.open_anchors:
                raise YamlLimitError(line, f"alias *{name} refers to itself")
            self.count(self.sizes.get(name, 1), line)
        elif isinstance(event, CollectionStartEvent):
            if len(self.stack) >= MAX_DEPTH:
                raise YamlLimitError(line, f"nested deeper than {MAX_DEPTH} levels")
            self.count(1, line)
            anchor = None if event.anchor is None else str(event.anchor)
            self.stack.append(_Open(anchor))
            if anchor is not None:
                self.open_anchors.add(anchor)
        elif isinstance(event, CollectionEndEvent):
            done = self.stack.pop()
            if done.anchor is not None:
                self.open_anchors.discard(done.anchor)
                self.sizes[done.anchor] = done.nodes
        elif isinstance(event, NodeEvent):  # a scalar
            if event.anchor is not None:
                self.sizes[str(event.anchor)] = 1
            self.count(1, line)


def check_yaml_limits(text: str) -> None:
    """Raise YamlLimitError (with a 1-based line) for text over a bound; syntax errors are
    left to the real load, which reports them with their own line."""
    if len(text.encode("utf-8")) > MAX_POLICY_BYTES:
        raise YamlLimitError(1, f"the policy file is larger than {MAX_POLICY_BYTES} bytes")
    _check_flow_depth(text)
    walk = _Walk()
    try:
        for event in YAML(typ="rt").parse(text):
            walk.on_event(event)
    except MarkedYAMLError:
        return


def _check_flow_depth(text: str) -> None:
    """Bracket nesting counted on the raw text, before the YAML scanner sees it: the scanner
    is quadratic in consecutive open brackets (a few thousand `[` cost seconds). Brackets
    inside strings count too, which only errs on the safe side."""
    depth = 0
    for bracket in _BRACKET.finditer(text):
        depth = depth + 1 if bracket.group() in "[{" else max(0, depth - 1)
        if depth > MAX_DEPTH:
            line = text.count("\n", 0, bracket.start()) + 1
            raise YamlLimitError(line, f"nested deeper than {MAX_DEPTH} levels")
