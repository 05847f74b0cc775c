"""The JSON behind the status page (`GET /v1/status`), built from what the admin server reads:
the scheduler snapshot, the metrics registry, the policy reloader, the engine readings and the
service's last rejections.

Rates, recent latency quantiles and the pools' limit history are differences between
successive calls (the page polls about once a second), kept here in bounded form: the service
itself exposes totals and the present only.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from extproc.metrics import Metrics
from extproc.policy import Policy
from extproc.reload import PolicyReloader
from extproc.status.engines import EngineReader
from extproc.status.history import REJECTIONS, Reading, Readings
from extproc.status.readings import Percentiles, subtract_buckets

REMOVED_TIER = "(removed)"
"""Where tenants that a reload removed, with requests still in flight, are listed."""


class StatusView:
    def __init__(
        self,
        *,
        rate_window_s: float = 10.0,
        latency_window_s: float = 60.0,
        history_points: int = 120,
        history_every_s: float = 1.0,
        readings_every_s: float = 5.0,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self.history_every_s = history_every_s
        self.now = now
        self.wall = wall
        # Readings hold every tenant's histograms: kept a few seconds apart, they cost little
        # memory, and a rate still has a baseline from the page's first update on.
        self.readings = Readings(readings_every_s, max(rate_window_s, latency_window_s))
        self.history_points = history_points
        self.limit_history: dict[str, deque[list[float]]] = {}
        """pool -> [wall time, soft limit, hard limit, in flight, queued] points."""

    def build(
        self,
        policy: Policy,
        snapshot: Mapping[str, Any],
        metrics: Metrics,
        *,
        reloader: PolicyReloader | None = None,
        engines: EngineReader | None = None,
        rejections: Sequence[Mapping[str, Any]] = (),
        overload: Mapping[str, Any] | None = None,
        draining: bool = False,
    ) -> dict[str, Any]:
        """`rejections`: the service's last answers it gave itself, newest first
        (`Gateway.recent_rejections`); each is shown with how the page names its reason.
        `overload`: whether the service sheds because it falls behind
        (`OverloadDetector.describe`), shown as it is."""
        now, wall = self.now(), self.wall()
        reading = Reading.of(metrics, now)
        rates_from = self.readings.baseline(now, self.rate_window_s)
        latency_from = self.readings.baseline(now, self.latency_window_s)
        pools = snapshot.get("pools", {})
        self._record_limits(pools, wall)
        self.readings.add(reading)
        fairness = snapshot.get("fairness") or policy.source.fairness.policy
        return {
            "generated_at": wall,
            "draining": draining,
            "overload": overload,
            "queued": snapshot.get("queued", 0),
            "inflight": snapshot.get("leases", 0),
            "policy": policy_view(policy, metrics, reloader, fairness),
            "windows": {
                "rates_s": None if rates_from is None else round(now - rates_from.at, 2),
                "latency_s": None if latency_from is None else round(now - latency_from.at, 2),
            },
            "tiers": self._tiers(policy, snapshot, fairness, reading, rates_from, latency_from),
            "pools": [
                self._pool(name, pool, policy, engines) for name, pool in sorted(pools.items())
            ],
            "rejections": [
                {**entry, "reason": REJECTIONS.get(entry["outcome"], entry["outcome"])}
                for entry in rejections
            ],
        }

    # -- tenants ------------------------------------------------------------------------------

    def _tiers(
        self,
        policy: Policy,
        snapshot: Mapping[str, Any],
        fairness: str,
        reading: Reading,
        rates_from: Reading | None,
        latency_from: Reading | None,
    ) -> list[dict[str, Any]]:
        states: Mapping[str, Any] = snapshot.get("tenants", {})
        order = [*policy.source.tiers, REMOVED_TIER]
        grouped: dict[str, list[dict[str, Any]]] = {tier: [] for tier in order}
        outcomes: dict[str, dict[str, int]] = {}
        for (tenant, _tier, _pool, outcome), total in reading.requests.items():
            if total > 0:
                counts = outcomes.setdefault(tenant, {})
                counts[outcome] = counts.get(outcome, 0) + int(total)
        places = FairPlaces(states, fairness)
        for name, state in sorted(states.items()):
            tier = state.get("tier") or REMOVED_TIER
            row = self._tenant(
                name, state, outcomes.get(name, {}), reading, rates_from, latency_from
            )
            row["fair_share"] = places.of(name, tier)
            grouped.setdefault(tier, []).append(row)
        return [{"name": tier, "tenants": rows} for tier, rows in grouped.items() if rows]

    def _tenant(
        self,
        name: str,
        state: Mapping[str, Any],
        outcomes: Mapping[str, int],
        reading: Reading,
        rates_from: Reading | None,
        latency_from: Reading | None,
    ) -> dict[str, Any]:
        ttft = reading.ttft.get(name, ())
        wait = reading.queue_wait.get(name, ())
        inter_token = reading.inter_token.get(name, ())
        if latency_from is not None:
            ttft = subtract_buckets(ttft, latency_from.ttft.get(name))
            inter_token = subtract_buckets(inter_token, latency_from.inter_token.get(name))
            wait = subtract_buckets(wait, latency_from.queue_wait.get(name))
        return {
            "name": name,
            "weight": state.get("weight"),
            "queued": state.get("queued", 0),
            "inflight": state.get("inflight", 0),
            "inflight_tokens": state.get("inflight_tokens", 0),
            "served_tokens": state.get("served_tokens", 0),
            "admitted": outcomes.get("admitted", 0),
            "rejected": sum(n for outcome, n in outcomes.items() if outcome in REJECTIONS),
            "outcomes": dict(outcomes),
            "tokens_per_s": self._token_rates(name, reading, rates_from),
            "ttft": Percentiles.of(ttft).as_json(),
            "inter_token": Percentiles.of(inter_token).as_json(),
            "queue_wait": Percentiles.of(wait).as_json(),
        }

    @staticmethod
    def _token_rates(name: str, reading: Reading, since: Reading | None) -> dict[str, float] | None:
        if since is None or reading.at <= since.at:
            return None
        span = reading.at - since.at
        rates: dict[str, float] = {}
        for direction in ("input", "output"):
            key = (name, direction)
            delta = reading.tokens.get(key, 0.0) - since.tokens.get(key, 0.0)
            rates[direction] = round(max(0.0, delta) / span, 1)
        return rates

    # -- pools --------------------------------------------------------------------------------

    def _record_limits(self, pools: Mapping[str, Any], wall: float) -> None:
        for name in list(self.limit_history):
            if name not in pools:
                del self.limit_history[name]
        for name, pool in pools.items():
            points = self.limit_history.setdefault(name, deque(maxlen=self.history_points))
            if points and wall - points[-1][0] < self.history_every_s:
                continue
            points.append(
                [
                    round(wall, 3),
                    pool.get("max_inflight", 0),
                    pool.get("hard_inflight", pool.get("max_inflight", 0)),
                    pool.get("inflight", 0),
                    pool.get("queued", 0),
                ]
            )

    def _pool(
        self, name: str, pool: Mapping[str, Any], policy: Policy, engines: EngineReader | None
    ) -> dict[str, Any]:
        spec = policy.pools.get(name)
        endpoints = list(spec.endpoints) if spec is not None else []
        drain = pool.get("drain_rate")
        return {
            "name": name,
            "inflight": pool.get("inflight", 0),
            "inflight_tokens": pool.get("inflight_tokens", 0),
            "queued": pool.get("queued", 0),
            "soft_limit": pool.get("max_inflight"),
            "hard_limit": pool.get("hard_inflight"),
            "max_inflight_tokens": pool.get("max_inflight_tokens"),
            "adaptive": bool(pool.get("adaptive")),
            "configured_max_inflight": pool.get("configured_max_inflight"),
            "limit_increases": pool.get("limit_increases"),
            "limit_decreases": pool.get("limit_decreases"),
            "drain_rate": None if drain is None else round(drain, 2),
            "retired": pool.get("retired", False),
            "history": list(self.limit_history.get(name, ())),
            "engines": engines.pool_engines(endpoints) if engines is not None else [],
        }


class FairPlaces:
    """Each tenant's fair-share counter per pool and its place among its tier's tenants (1:
    served next). A VTC counter counts service received (lowest goes first); a DRR deficit
    counts credit not yet spent (highest goes first)."""

    def __init__(self, states: Mapping[str, Any], fairness: str) -> None:
        self.states = states
        self.lowest_first = fairness == "vtc"
        self.sorted_levels: dict[tuple[str, str], list[float]] = {}
        for state in states.values():
            tier = state.get("tier") or REMOVED_TIER
            for pool, level in (state.get("fair_share") or {}).items():
                self.sorted_levels.setdefault((tier, pool), []).append(level)
        for levels in self.sorted_levels.values():
            levels.sort()

    def of(self, name: str, tier: str) -> list[dict[str, Any]]:
        mine = self.states.get(name, {}).get("fair_share") or {}
        places: list[dict[str, Any]] = []
        for pool, level in sorted(mine.items()):
            levels = self.sorted_levels.get((tier, pool), [])
            if self.lowest_first:
                ahead = bisect.bisect_left(levels, level)
            else:
                ahead = len(levels) - bisect.bisect_right(levels, level)
            places.append(
                {"pool": pool, "level": round(level, 2), "position": ahead + 1, "of": len(levels)}
            )
        return places


def policy_view(
    policy: Policy, metrics: Metrics, reloader: PolicyReloader | None, fairness: str
) -> dict[str, Any]:
    last = reloader.last_result if reloader is not None else None
    attempted = [
        sample.value
        for family in metrics.policy_last_reload.collect()
        for sample in family.samples
        if sample.value > 0
    ]
    return {
        "file": policy.file,
        "fingerprint": (reloader.fingerprint or None) if reloader is not None else None,
        "fairness": fairness,
        "tenants": len(policy.tenants),
        "last_reload": None
        if last is None
        else {**last.as_json(), "at": max(attempted) if attempted else None},
    }
