"""Durations and sizes as Envoy, Istio and Kubernetes spell them."""

from __future__ import annotations

import re

from extproc.envoy_lint.source import Node

_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?\s*$")
_QUANTITY_FACTOR = {
    None: 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def seconds(node: Node) -> float | None:
    """Seconds from "630s", "10m30s", "500ms", {seconds: 630} or a bare number; None if not one."""
    value = node.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        parts = _GO_DURATION.findall(text)
        if parts and "".join(number + unit for number, unit in parts) == text:
            return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
        return None
    if node.is_map:
        whole, nanos = node.get("seconds"), node.get("nanos")
        total = 0.0
        for part, scale in ((whole, 1.0), (nanos, 1e-9)):
            if part is not None:
                amount = _number(part.value)
                if amount is None:
                    return None
                total += amount * scale
        return total if whole is not None or nanos is not None else None
    return None


def byte_count(node: Node) -> int | None:
    """Bytes from 8388608, "8388608" or a Kubernetes quantity such as "8Mi"; None if not one."""
    value = node.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match:
            return int(float(match.group(1)) * _QUANTITY_FACTOR[match.group(2)])
    return None


def flag(node: Node) -> bool | None:
    """A boolean, also as Envoy's wrapper {value: true}."""
    if isinstance(node.value, bool):
        return node.value
    inner = node.get("value")
    if inner is not None and isinstance(inner.value, bool):
        return inner.value
    return None


def integer(node: Node) -> int | None:
    """An integer, also as a string or Envoy's wrapper {value: N}."""
    inner = node.get("value")
    value = inner.value if inner is not None else node.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def format_seconds(value: float) -> str:
    return f"{value * 1000:g}ms" if 0 < value < 1 else f"{value:g}s"


def format_bytes(value: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if value and value % (1 << shift) == 0:
            return f"{value >> shift} {unit}"
    return f"{value} bytes"
