"""Detecting that the service itself falls behind, and shedding the tenants above their share.

Under CPU saturation an asyncio service answers every message late, and Envoy turns an answer
later than its `message_timeout` into an empty 504 for whoever sent it, light tenant or heavy.
Two cheap signals say the service is falling behind (`gateway.overload` in the policy):

* event-loop lag: a monitor task sleeps `interval_ms` and measures how late it wakes up. Every
  message Envoy sends waits behind the same ready queue, so the lag is what each answer pays;
* message age: the admission streams Envoy waits on (opened, their request body not answered
  or held yet); the oldest one's age is compared with `message_age_fraction` of
  `gateway.message_timeout`.

While either is over its threshold (lag: two samples within half a second, so one collector
pause does not count) and for `recover_ms` after, the service sheds: new requests of the
tenants above their fair share (`Scheduler.over_share`, refreshed every sample) get 429 +
Retry-After at submit, and their queued requests are answered the same way at once. Tenants
within their share are never shed: what is left of the service's time goes to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from extproc.policy.model import Gateway as GatewaySettings

log = logging.getLogger("extproc.overload")

LAG_SAMPLES = 2
LAG_WINDOW_S = 0.5
"""Shedding starts when LAG_SAMPLES samples within LAG_WINDOW_S are over the threshold: one
stall (a collection, a reload) is not load, while a saturated loop (or a process the host
keeps descheduling) is late sample after sample."""


class OverloadDetector:
    """The signals and the shedding state; synchronous, on an injected clock (unit-tested)."""

    def __init__(
        self,
        gateway: GatewaySettings,
        over_share: Callable[[], set[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configure(gateway)
        self._over_share = over_share
        self._clock = clock
        self._pending: dict[object, float] = {}
        """Admission streams Envoy waits on -> when they opened (insertion order = age)."""
        self._late_samples: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._last_over: float | None = None
        self.reason: str | None = None
        """Why the service sheds now ("lag" or "message_age"), None when it does not."""
        self.lag_s = 0.0
        self.shed_set: frozenset[str] = frozenset()
        """The tenants shed while `reason` is set (over their share at the last sample)."""

    def configure(self, gateway: GatewaySettings) -> None:
        """The policy's `gateway.overload` and `gateway.message_timeout` (also on reload; the
        monitor's interval and whether it runs at all are fixed when it starts)."""
        settings = self.settings = gateway.overload
        self._lag_threshold_s = settings.lag_threshold_ms / 1000.0
        self._age_limit_s = settings.message_age_fraction * gateway.message_timeout
        self._recover_s = settings.recover_ms / 1000.0

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # -- signals ---------------------------------------------------------------------------

    def stream_opened(self, key: object) -> None:
        self._pending[key] = self._clock()

    def stream_answered(self, key: object) -> None:
        self._pending.pop(key, None)

    def oldest_pending_age(self, now: float) -> float:
        for opened in self._pending.values():
            return now - opened
        return 0.0

    def observe(self, lag_s: float) -> bool:
        """One monitor sample: update the state; True if the service sheds now."""
        now = self._clock()
        self.lag_s = lag_s
        if not self.settings.enabled:
            self.reason, self._last_over, self.shed_set = None, None, frozenset()
            return False
        late = self._late_samples
        reason: str | None = None
        if lag_s > self._lag_threshold_s:
            late.append(now)
            if len(late) == LAG_SAMPLES and now - late[0] <= LAG_WINDOW_S:
                reason = "lag"
        if reason is None and self.oldest_pending_age(now) > self._age_limit_s:
            reason = "message_age"
        if reason is not None:
            if self.reason is None:
                log.warning(
                    "falling behind (%s; loop lag %.0f ms, oldest unanswered message %.0f ms): "
                    "shedding tenants above their fair share",
                    reason,
                    lag_s * 1000.0,
                    self.oldest_pending_age(now) * 1000.0,
                )
            self._last_over = now
            self.reason = reason
        elif self._last_over is not None and now - self._last_over >= self._recover_s:
            log.info("caught up: shedding stopped")
            self._last_over = None
            self.reason = None
        self.shed_set = frozenset(self._over_share()) if self.reason is not None else frozenset()
        return self.reason is not None

    def sheds(self, tenant: str) -> bool:
        """Is a new request of this tenant shed now?"""
        return self.reason is not None and tenant in self.shed_set


class LagMonitor:
    """The asyncio side: samples the event-loop lag every `interval_ms` and feeds the detector;
    `on_sample` runs after each sample (the gateway sheds queued requests there)."""

    def __init__(self, detector: OverloadDetector, on_sample: Callable[[bool], None]) -> None:
        self.detector = detector
        self._on_sample = on_sample
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.detector.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.detector.settings.interval_ms / 1000.0
        while True:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - expected)
            try:
                self._on_sample(self.detector.observe(lag))
            except Exception:
                log.exception("overload sample failed")
