"""The capacity a benchmark asks the service for: adaptive limits and headroom per pool,
written into the policy's pool fields (the service is the ordinary `extproc serve`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from ruamel.yaml import YAML

from extproc.scheduler.adaptive import AdaptiveSettings


@dataclass(frozen=True)
class CapacityConfig:
    """Per pool: adaptive settings (soft limit follows the engines) and/or static headroom."""

    adaptive: Mapping[str, AdaptiveSettings] = field(default_factory=dict)
    headroom: Mapping[str, int] = field(default_factory=dict)
    """Static pools: requests reserved above `max_inflight - headroom` for tenants below
    their fair share."""

    def to_json(self) -> dict[str, Any]:
        return {
            "adaptive": {name: asdict(s) for name, s in self.adaptive.items()},
            "headroom": dict(self.headroom),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CapacityConfig:
        return cls(
            adaptive={
                name: AdaptiveSettings.from_mapping(values)
                for name, values in (data.get("adaptive") or {}).items()
            },
            headroom={name: int(v) for name, v in (data.get("headroom") or {}).items()},
        )

    def apply(self, policy_text: str) -> str:
        """The policy with these settings in its pools' `adaptive` and `headroom` fields
        (returned as JSON, which is YAML too)."""
        policy = YAML(typ="safe").load(policy_text)
        pools = policy["pools"]
        for name, settings in self.adaptive.items():
            pools[name]["adaptive"] = {
                "min_inflight": settings.min_inflight,
                "initial_inflight": settings.initial_inflight,
                "target_waiting": settings.target_waiting,
                "kv_target": settings.kv_target,
                "increase": settings.increase,
                "decrease": settings.decrease,
                "cooldown": settings.cooldown_s,
                "smoothing": settings.smoothing,
                "poll_interval": settings.poll_interval_s,
            }
            pools[name]["headroom"] = settings.headroom
        for name, headroom in self.headroom.items():
            pools[name]["headroom"] = headroom
        return orjson.dumps(policy, option=orjson.OPT_INDENT_2).decode()
