"""Read a YAML or JSON file (several documents too) into nodes that know their line numbers.

Envoy accepts both spellings of a field (`stream_idle_timeout`, `streamIdleTimeout`: the
render writes the JSON one), so a lookup by the snake_case name finds either.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError


class UnreadableFile(Exception):
    """The file cannot be read or parsed; the message names the file (and line when known)."""


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass(frozen=True)
class Node:
    """A value of the file and the 1-based line it starts on."""

    value: Any
    line: int

    @property
    def is_map(self) -> bool:
        return isinstance(self.value, CommentedMap)

    @property
    def is_list(self) -> bool:
        return isinstance(self.value, CommentedSeq)

    def get(self, key: str) -> Node | None:
        """The child `key` (snake_case, or its camelCase spelling), or None."""
        if not isinstance(self.value, CommentedMap):
            return None
        for name in (key, camel_case(key)):
            if name in self.value:
                return Node(self.value[name], _key_line(self.value, name, self.line))
        return None

    def at(self, *keys: str) -> Node | None:
        node: Node | None = self
        for key in keys:
            node = node.get(key) if node is not None else None
        return node

    def items(self) -> list[Node]:
        """The elements of a list (empty for anything else)."""
        if not isinstance(self.value, CommentedSeq):
            return []
        return [Node(item, self.value.lc.item(i)[0] + 1) for i, item in enumerate(self.value)]

    def entries(self) -> list[tuple[str, Node]]:
        """The (key, child) pairs of a mapping, keys as written (they may be names: filters)."""
        if not isinstance(self.value, CommentedMap):
            return []
        return [
            (str(key), Node(value, _key_line(self.value, key, self.line)))
            for key, value in self.value.items()
        ]

    def text(self) -> str | None:
        return self.value if isinstance(self.value, str) else None

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Every keyed descendant, depth first, keys in snake_case."""
        for key, child in self.entries():
            yield snake_case(key), child
            yield from child.walk()
        for item in self.items():
            yield from item.walk()


def _key_line(mapping: CommentedMap, key: Any, fallback: int) -> int:
    """The 1-based line of `key`, also when it comes from a YAML merge (`<<: *anchor`)."""
    try:
        return int(mapping.lc.key(key)[0]) + 1
    except KeyError:
        for source in getattr(mapping, "merge", []):
            if isinstance(source, tuple):  # older ruamel.yaml: (position, mapping)
                source = source[1]
            if isinstance(source, CommentedMap) and key in source:
                return _key_line(source, key, fallback)
        return fallback


def load_documents(path: str) -> list[Node]:
    """The file's non-empty documents; raises UnreadableFile."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UnreadableFile(f"{path}: cannot read: {error}") from error
    try:
        documents = list(YAML(typ="rt").load_all(text))
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UnreadableFile(f"{path}{line}: cannot parse: {problem}") from error
    nodes = [Node(doc, _first_line(doc)) for doc in documents if doc is not None]
    if not nodes:
        raise UnreadableFile(f"{path}: empty file")
    return nodes


def _first_line(document: Any) -> int:
    if isinstance(document, CommentedMap | CommentedSeq) and document.lc.line is not None:
        return int(document.lc.line) + 1
    return 1
