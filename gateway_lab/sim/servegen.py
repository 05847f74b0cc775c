"""Multi-tenant scenarios from real per-client statistics (ServeGen, Alibaba Bailian).

`servegen_client_summary.csv` gives, per client of a model: the mean request rate while active,
the burstiness (coefficient of variation of inter-arrival times) and the mean input and output
tokens. A scenario turns N clients into N tenants:

- arrivals: a renewal process per client with gamma-distributed gaps, mean 1/rate and the
  client's cv (shape 1/cv^2; cv 1 is Poisson, cv 9 is very bursty); every chosen client is
  active for the whole scenario at its mean active rate (times `rate_scale`);
- token counts: lognormal with the client's mean. The spread comes from the per-window summary
  next to it when available (sigma = ln(p90/p50) / 1.2816, request-weighted over the client's
  windows), else sigma = 1.0 for input and 0.8 for output; totals are capped at
  `max_total_tokens`;
- tiers: the i-th chosen client (by volume) gets tier i mod len(tiers), so every tier has
  large and small clients.

Clients are picked among those with token statistics (`has_dataset`), either the N busiest
(`pick="top"`) or N spread evenly over the volume ranking (`pick="spread"`).
"""

from __future__ import annotations

import csv
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from extproc.policy.model import Limits, Tenant
from extproc.policy.runtime import Policy, compile_policy
from gateway_lab.sim.trace import TraceRequest

_Z90 = 1.2815515655446004
DEFAULT_INPUT_SIGMA = 1.0
DEFAULT_OUTPUT_SIGMA = 0.8
WINDOW_FILE = "servegen_client_window_summary.csv"


@dataclass(frozen=True, slots=True)
class ClientStats:
    model: str
    client_id: str
    requests_total: float
    mean_rps: float
    peak_rps: float
    cv: float
    input_mean: float
    output_mean: float
    input_sigma: float = DEFAULT_INPUT_SIGMA
    output_sigma: float = DEFAULT_OUTPUT_SIGMA

    @property
    def tenant(self) -> str:
        return f"sg-{self.model}-{self.client_id}"


def _float(value: str | None) -> float | None:
    if value is None or value.strip() == "":
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _sigmas(path: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """(model, client) -> (input sigma, output sigma) from the per-window summary."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    with path.open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            weight = _float(row.get("expected_requests")) or 0.0
            key = (row["model"], row["client_id"])
            for offset, prefix in ((0, "in"), (2, "out")):
                p50 = _float(row.get(f"{prefix}_p50"))
                p90 = _float(row.get(f"{prefix}_p90"))
                if weight > 0 and p50 and p90 and p50 > 0 and p90 >= p50:
                    sums[key][offset] += weight * math.log(p90 / p50) / _Z90
                    sums[key][offset + 1] += weight
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for key, (s_in, w_in, s_out, w_out) in sums.items():
        sigma_in = s_in / w_in if w_in else DEFAULT_INPUT_SIGMA
        sigma_out = s_out / w_out if w_out else DEFAULT_OUTPUT_SIGMA
        out[key] = (min(2.5, max(0.1, sigma_in)), min(2.5, max(0.1, sigma_out)))
    return out


def load_clients(path: str | Path, model: str | None = "m-large") -> list[ClientStats]:
    """Clients with rates and token means, busiest first (model None: every model)."""
    path = Path(path)
    window = path.with_name(WINDOW_FILE)
    sigmas = _sigmas(window) if window.exists() else {}
    clients: list[ClientStats] = []
    with path.open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if model is not None and row["model"] != model:
                continue
            rate = _float(row.get("mean_rate_rps_when_active"))
            cv = _float(row.get("mean_cv_when_active"))
            in_mean = _float(row.get("in_mean_weighted"))
            out_mean = _float(row.get("out_mean_weighted"))
            if not rate or rate <= 0 or cv is None or not in_mean or not out_mean:
                continue
            sigma_in, sigma_out = sigmas.get(
                (row["model"], row["client_id"]), (DEFAULT_INPUT_SIGMA, DEFAULT_OUTPUT_SIGMA)
            )
            clients.append(
                ClientStats(
                    model=row["model"],
                    client_id=row["client_id"],
                    requests_total=_float(row.get("expected_requests_total")) or 0.0,
                    mean_rps=rate,
                    peak_rps=_float(row.get("peak_rate_rps")) or rate,
                    cv=max(0.05, cv),
                    input_mean=in_mean,
                    output_mean=out_mean,
                    input_sigma=sigma_in,
                    output_sigma=sigma_out,
                )
            )
    clients.sort(key=lambda c: (-c.requests_total, c.client_id))
    return clients


def pick_clients(
    clients: Sequence[ClientStats], count: int, pick: Literal["top", "spread"] = "top"
) -> list[ClientStats]:
    if count < 1:
        raise ValueError("count must be >= 1")
    if count > len(clients):
        raise ValueError(f"only {len(clients)} clients have rates and token statistics")
    if pick == "top" or count == len(clients):
        return list(clients[:count])
    step = (len(clients) - 1) / max(1, count - 1)
    return [clients[round(i * step)] for i in range(count)]


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def generate(
    clients: Sequence[ClientStats],
    duration: float,
    *,
    seed: int = 0,
    rate_scale: float = 1.0,
    max_total_tokens: int = 131_072,
) -> list[TraceRequest]:
    """Requests of every client over `duration` seconds, merged in time order."""
    if duration <= 0 or rate_scale <= 0:
        raise ValueError("duration and rate_scale must be > 0")
    out: list[TraceRequest] = []
    for number, client in enumerate(clients):
        rng = random.Random(f"{seed}:{number}:{client.client_id}")
        shape = 1.0 / (client.cv * client.cv)
        mean_gap = 1.0 / (client.mean_rps * rate_scale)
        scale = mean_gap / shape
        at = rng.gammavariate(shape, scale) * rng.random()
        while at < duration:
            output = max(1, round(_lognormal(rng, client.output_mean, client.output_sigma)))
            output = min(output, max_total_tokens - 1)
            prompt = max(1, round(_lognormal(rng, client.input_mean, client.input_sigma)))
            prompt = min(prompt, max_total_tokens - output)
            out.append(TraceRequest(at, prompt, output, client.tenant))
            at += rng.gammavariate(shape, scale)
    out.sort(key=lambda r: r.at)
    return out


def scenario_tenants(clients: Sequence[ClientStats], tiers: Sequence[str]) -> dict[str, Tenant]:
    """A tenant per client, tiers assigned round-robin by volume rank."""
    limits = Limits(max_queued=1024, max_queue_wait=60.0)
    return {
        client.tenant: Tenant(tier=tiers[i % len(tiers)], limits=limits)
        for i, client in enumerate(clients)
    }


def scenario_policy(base: Policy, clients: Sequence[ClientStats]) -> Policy:
    """`base` (tiers, pools, fairness) with its tenants replaced by the scenario's."""
    tenants = scenario_tenants(clients, base.source.tiers)
    source = base.source.model_copy(update={"tenants": tenants})
    return compile_policy(source, base.file)
