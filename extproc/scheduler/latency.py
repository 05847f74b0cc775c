"""The δ guarantee: what a request would get alone, how much later each tenant gets its
tokens, and the controller that turns a tier's `latency_delta` objective into how much of a
pool the backlogged tenants may use.

The accounting stream reports each admitted request's first token (`Scheduler.first_token`)
and every later chunk (`Scheduler.charge_output`); the scheduler's clock times them from the
request's submit, so the simulator drives the same code.

* *Alone* (`AloneModel`, per pool): time to first token as a + b * prompt tokens, fitted online
  (exponentially weighted least squares) from requests admitted while the pool was nearly
  idle (nothing else prefilling, at most `IDLE_INFLIGHT` others in flight, and still nothing
  else prefilling at its first token); the decode step (seconds per output token) from
  chunks of requests while at most `LOW_BATCH` were in flight and none prefilling. Without
  the prefilling rule a pool the controller holds at its floor (one backlogged request at a
  time) taught the model its flooder's prefill steps as "alone", and the δ shrank.
* *δ* (`TenantDelta`, per tenant): the k-th token of a request arrives `lag = elapsed -
  (ttft_alone + (k - 1) * step_alone)` later than alone. The TTFT δ is the lag at the first
  token; the token δ the per-token gap minus the alone step. Both are published as an
  exponentially weighted mean and as the largest recent value (decaying).
* *Controller* (`DeltaController`, per pool): a factor f in [`MIN_FACTOR`, 1] on the
  backlogged tenants' part of the pool: they are dispatched only while the pool's in-flight
  requests are below f x its soft limit and its prefilling prompt tokens below f x its prefill
  budget (in a pool without one, its prompts prefilling at once below f ** `PACING_EXPONENT` x
  its soft limit). A light tenant's tier names what it watches (`LatencyDelta` in
  extproc/policy/model.py): the TTFT δ against `first_token`, the k-th token's lag against
  `every_token`, each gap's δ against `token_gap`; an objective is seconds of lag, or a
  multiple of the alone time (`2x`: lag up to the alone time, `allowed_lag`), which means
  the same on fast and slow engines. A sample above its objective cuts f by
  `DECREASE` (at most once per `COOLDOWN_S`); one below half its objective raises it by
  `INCREASE_PER_S` per second of such slack (AIMD), which settles where roughly a third of
  the samples exceed the objective. With the tier's `quantile` q set, the controller tracks
  that quantile instead (stochastic approximation on ln f): the samples are taken in windows
  of `COOLDOWN_S`, and each window moves ln f by `QUANTILE_GAIN` x ((1 - q) - v), v being
  the share of its samples above their objective. So f stops moving on average only where a
  share 1 - q of the samples exceed the objective; one window, however many of its samples
  a slow engine step made late together, moves f once (the engines answer a cut only after
  the work in flight drains).
  Light tenants are never held back by it; the engines' own waiting queue stays with the
  adaptive limit (extproc/scheduler/adaptive.py), which the factor only lowers.
"""

from __future__ import annotations

import math

from extproc.policy.model import AloneMultiple, Objective

IDLE_INFLIGHT = 1
"""A request admitted while at most this many others were in flight (none prefilling) is a
sample of what it would get alone."""
LOW_BATCH = 2
"""A chunk of a request while at most this many were in flight is a sample of the alone step."""
MIN_SAMPLES = 3
SAMPLE_HALFLIFE = 50.0
"""Samples after which an old one weighs half (the engines may change under us)."""
DELTA_ALPHA = 0.1
"""Weight of a new sample in the published mean δ."""
PEAK_HALFLIFE_S = 10.0
"""The published peak δ decays by half in this time."""

_KEEP = math.pow(0.5, 1.0 / SAMPLE_HALFLIFE)

MIN_FACTOR = 0.05
DECREASE = 0.7
COOLDOWN_S = 0.5
INCREASE_PER_S = 0.2
MAX_INCREASE_STEP_S = 0.5
"""A longer quiet spell raises the factor as if it lasted this long (no jump after idle)."""
PACING_EXPONENT = 4
"""In a pool without a prefill budget the controller paces too: backlogged tenants wait while
the pool's prompts prefilling at once reach f ** 4 of the soft limit (one cut: a quarter;
three: one prompt). A binding in-flight limit alone lets the queued flooder refill the slots
that free together, and those prompts prefill in one step beside the light tenant's; steeper
than f so the groups go first, and continuous so lifting the cut does not admit a group at
once."""
QUANTILE_GAIN = 0.5
"""The quantile rule's gain on ln f per window: at q = 0.99 a window of late samples cuts f
by ~40% and a window without one raises it by ~0.5% (1% a second). The time to settle is
a few times 1 / (1 - q) windows with samples: at q = 0.99 minutes, and with a kind of token
that comes rarely (`first_token` at one request a second) the windows are mostly empty."""
_LOG_MIN_FACTOR = math.log(MIN_FACTOR)


class _Fit:
    """Exponentially weighted least squares of y on x."""

    __slots__ = ("n", "sw", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.n = 0
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = _KEEP
        self.n += 1
        self.sw = self.sw * keep + 1.0
        self.sx = self.sx * keep + x
        self.sy = self.sy * keep + y
        self.sxx = self.sxx * keep + x * x
        self.sxy = self.sxy * keep + x * y

    def predict(self, x: float) -> float | None:
        if self.n < MIN_SAMPLES:
            return None
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        slope = 0.0
        # One prompt size (or nearly): no slope to learn, the mean is the answer.
        if var > 1e-6 * max(1.0, mean_x * mean_x):
            slope = max(0.0, (self.sxy / self.sw - mean_x * mean_y) / var)
        return max(0.0, mean_y + slope * (x - mean_x))


class AloneModel:
    """What a request would get alone in one pool (see the module docstring)."""

    __slots__ = ("_step", "_ttft")

    def __init__(self) -> None:
        self._ttft = _Fit()
        self._step = _Fit()

    def observe_ttft(self, prompt_tokens: int, ttft_s: float) -> None:
        self._ttft.add(float(prompt_tokens), ttft_s)

    def observe_step(self, seconds_per_token: float) -> None:
        self._step.add(0.0, seconds_per_token)

    def ttft(self, prompt_tokens: int) -> float | None:
        return self._ttft.predict(float(prompt_tokens))

    def step(self) -> float | None:
        return self._step.predict(0.0)

    def describe(self) -> dict[str, float | int | None]:
        return {
            "ttft_samples": self._ttft.n,
            "step_samples": self._step.n,
            "step_s": self.step(),
        }


class _Tracked:
    """A mean and a decaying peak of one δ series."""

    __slots__ = ("mean", "peak", "peak_at", "samples")

    def __init__(self) -> None:
        self.mean: float | None = None
        self.peak = 0.0
        self.peak_at = 0.0
        self.samples = 0

    def add(self, value: float, now: float) -> None:
        self.samples += 1
        self.mean = value if self.mean is None else self.mean + DELTA_ALPHA * (value - self.mean)
        if value >= self.peak_now(now):
            self.peak, self.peak_at = value, now

    def peak_now(self, now: float) -> float:
        if self.samples == 0:
            return 0.0
        return self.peak * math.pow(0.5, max(0.0, now - self.peak_at) / PEAK_HALFLIFE_S)

    def describe(self, now: float) -> dict[str, float | int | None]:
        return {
            "mean_s": self.mean,
            "peak_s": self.peak_now(now) if self.samples else None,
            "samples": self.samples,
        }


class TenantDelta:
    """How much later than alone one tenant gets its first tokens and its later tokens."""

    __slots__ = ("tokens", "ttft")

    def __init__(self) -> None:
        self.ttft = _Tracked()
        self.tokens = _Tracked()

    def describe(self, now: float) -> dict[str, dict[str, float | int | None]]:
        return {"ttft": self.ttft.describe(now), "tokens": self.tokens.describe(now)}


def allowed_lag(objective: Objective, alone_s: float) -> float:
    """The lag `objective` allows a token that would take `alone_s` alone: a duration as it
    is, a multiple of alone (`AloneMultiple`) scaled by that time."""
    if isinstance(objective, AloneMultiple):
        return objective.allowed_lag(alone_s)
    return objective


class DeltaController:
    """The backlogged tenants' factor of one pool (see the module docstring)."""

    __slots__ = (
        "_decreased_at",
        "_updated_at",
        "_window_excess",
        "_window_samples",
        "_window_start",
        "factor",
        "violations",
    )

    def __init__(self) -> None:
        self.factor = 1.0
        self.violations = 0
        self._decreased_at = -math.inf
        self._updated_at: float | None = None
        self._window_start = -math.inf
        self._window_samples = 0
        self._window_excess = 0.0
        """The sum over the window's samples of (1 if late else 0) - (1 - q)."""

    def observe(
        self, lag_s: float, objective_s: float, now: float, quantile: float | None = None
    ) -> None:
        """A light tenant's token arrived `lag_s` later than alone; its tier wants at most
        `objective_s` (for a share `quantile` of the samples, when set)."""
        last, self._updated_at = self._updated_at, now
        if quantile is not None:
            self._track_quantile(lag_s > objective_s, quantile, now)
        elif lag_s > objective_s:
            self.violations += 1
            if now - self._decreased_at >= COOLDOWN_S:
                self.factor = max(MIN_FACTOR, self.factor * DECREASE)
                self._decreased_at = now
        elif lag_s < objective_s / 2 and last is not None:
            step = min(MAX_INCREASE_STEP_S, max(0.0, now - last))
            self.factor = min(1.0, self.factor + INCREASE_PER_S * step)

    def _track_quantile(self, violated: bool, quantile: float, now: float) -> None:
        if now - self._window_start >= COOLDOWN_S:
            self._close_window()
            self._window_start = now
        self.violations += violated
        self._window_samples += 1
        self._window_excess += violated - (1.0 - quantile)

    def _close_window(self) -> None:
        if self._window_samples == 0:
            return
        share = self._window_excess / self._window_samples
        log_factor = math.log(self.factor) - QUANTILE_GAIN * share
        self.factor = math.exp(min(0.0, max(_LOG_MIN_FACTOR, log_factor)))
        self._window_samples = 0
        self._window_excess = 0.0

    def limit(self, full: int) -> int:
        """`full` scaled by the factor, at least 1 (one backlogged request can always go)."""
        if self.factor >= 1.0:
            return full
        return max(1, int(full * self.factor))

    def prefilling_limit(self, soft: int) -> int:
        """Prompts prefilling at once (any tenant's) up to which a backlogged tenant may add
        one, in a pool without a prefill budget: f ** `PACING_EXPONENT` of its soft limit,
        at least 1."""
        if self.factor >= 1.0:
            return soft
        return max(1, int(soft * self.factor**PACING_EXPONENT))
