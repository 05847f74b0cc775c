"""Detecting that the service itself falls behind, and shedding the tenants above their share.

Under CPU saturation an asyncio service answers every message late, and Envoy turns an answer
later than its `message_timeout` into an empty 504 for whoever sent it, light tenant or heavy.
Cheap signals say the service is falling behind (`gateway.overload` in the policy):

* event-loop lag: a monitor timer fires every `interval_ms` and measures how late it runs. Every
  message Envoy sends waits behind the same ready queue, so the lag is what each answer pays.
  While there is nothing to protect (no admission stream open, nothing queued or in flight,
  the loop on time) it samples every IDLE_INTERVAL_S instead, and the first stream that opens
  brings the short interval back at once: an idle service does not wake 50 times a second;
* message age: the admission streams Envoy waits on (opened, their request body not answered
  or held yet); the oldest one's age is compared with `message_age_fraction` of
  `gateway.message_timeout`. So is the age a request's first message already had when it
  reached the handler (Envoy's `request.time` against ours, over the smallest such delay seen:
  extproc.service.arrival), which counts the time a new stream waited before the servicer was
  handed it, where the other two signals see nothing;
* CPU wait (`cpu_wait_fraction`, off unless set): the share of the last half second the
  event loop's thread was ready to run but had no CPU (extproc.service.cpu_wait). The loop
  can be on time by the lag's measure and still answer every message late, a few ms at a
  time, when the cores it shares with Envoy (and anything else) are oversubscribed.

While any is over its threshold (lag: two samples within half a second, so one collector
pause does not count) and for `recover_ms` after, the service sheds: new requests of the
tenants above their fair share (`Scheduler.over_share`; during an episode, see below) get 429 +
Retry-After at submit, and their queued requests are answered the same way at once. Tenants
within their share are never shed: what is left of the service's time goes to them. The
shed tenants' demand leaves the scheduler as it is shed, and once theirs has drained a light
tenant's one request in flight is most of what is left: by the share rule alone it would be
over and shed. So the tenants over their share when an episode of shedding begins stay shed
for the episode, and a tenant joins them during it only while it is over its share *and* has
a request queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from extproc.policy.model import Gateway as GatewaySettings
from extproc.service.arrival import ArrivalDelay
from extproc.service.cpu_wait import CpuWait, schedstat_path

log = logging.getLogger("extproc.overload")

LAG_SAMPLES = 2
LAG_WINDOW_S = 0.5
"""Shedding starts when LAG_SAMPLES samples within LAG_WINDOW_S are over the threshold: one
stall (a collection, a reload) is not load, while a saturated loop (or a process the host
keeps descheduling) is late sample after sample."""

IDLE_INTERVAL_S = 0.25
"""The monitor's interval while nothing is open, queued or in flight and its last sample was
on time: the first admission stream wakes it (`OverloadDetector.activity`), so detection under
load starts from the short interval as before. An idle sample that is late (the host keeps the
process descheduled: the next request would be answered late too) brings the short interval
back at once; at half LAG_WINDOW_S two late idle samples would count by themselves."""


class OverloadDetector:
    """The signals and the shedding state; synchronous, on an injected clock (unit-tested)."""

    def __init__(
        self,
        gateway: GatewaySettings,
        over_share: Callable[[], set[str]],
        clock: Callable[[], float] = time.monotonic,
        queued: Callable[[], set[str]] = set,
    ) -> None:
        self.configure(gateway)
        self._over_share = over_share
        self._queued = queued
        self._clock = clock
        self._pending: dict[object, float] = {}
        """Admission streams Envoy waits on -> since when: the stream's start, then its body's
        end (not the client's upload in between). Insertion order = age."""
        self._late_samples: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._last_over: float | None = None
        self.reason: str | None = None
        """Why the service sheds now ("lag", "message_age" or "cpu_wait"), None when it does
        not."""
        self.lag_s = 0.0
        self.cpu_wait: float | None = None
        """The event loop thread's latest share of time waiting for a CPU (None: unknown)."""
        self.shed_set: frozenset[str] = frozenset()
        """The tenants shed while `reason` is set: those over their share when the episode
        began, and those over it with requests queued since."""
        self.wake: Callable[[], None] | None = None
        """Set by an idle monitor, called (once) by the next `activity`."""
        self._arrival = ArrivalDelay()
        self._arrival_excess = 0.0
        """The largest arrival delay over its baseline since the last sample."""
        self.on_arrival: Callable[[float], None] | None = None
        """Told every arrival delay (the service's histogram of them)."""

    def configure(self, gateway: GatewaySettings) -> None:
        """The policy's `gateway.overload` and `gateway.message_timeout` (also on reload; the
        monitor's interval and whether it runs at all are fixed when it starts)."""
        settings = self.settings = gateway.overload
        self._lag_threshold_s = settings.lag_threshold_ms / 1000.0
        self._cpu_wait_limit = settings.cpu_wait_fraction
        self._age_limit_s = settings.message_age_fraction * gateway.message_timeout
        self._recover_s = settings.recover_ms / 1000.0

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # -- signals ---------------------------------------------------------------------------

    def stream_opened(self, key: object) -> None:
        self._pending[key] = self._clock()
        self.activity()

    def activity(self) -> None:
        """Work arrived (an admission stream, another process's request to account): an idle
        monitor goes back to its short interval."""
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake()

    @property
    def quiet(self) -> bool:
        """Not shedding, no admission stream waiting, the last sample on time."""
        return self.reason is None and not self._pending and self.lag_s <= self._lag_threshold_s

    def arrived(self, delay_s: float) -> None:
        """A request's first message reached the handler `delay_s` after Envoy received it
        (our wall clock minus Envoy's `request.time`)."""
        excess = self._arrival.excess(delay_s, self._clock())
        if excess > self._arrival_excess:
            self._arrival_excess = excess
        if self.on_arrival is not None:
            self.on_arrival(delay_s)

    def stream_answered(self, key: object) -> None:
        self._pending.pop(key, None)

    def oldest_pending_age(self, now: float) -> float:
        for opened in self._pending.values():
            return now - opened
        return 0.0

    def observe(self, lag_s: float, cpu_wait: float | None = None) -> bool:
        """One monitor sample (the loop's lag, its thread's share of time waiting for a CPU):
        update the state; True if the service sheds now."""
        now = self._clock()
        self.lag_s = lag_s
        self.cpu_wait = cpu_wait
        if not self.settings.enabled:
            self.reason, self._last_over, self.shed_set = None, None, frozenset()
            return False
        late = self._late_samples
        reason: str | None = None
        if lag_s > self._lag_threshold_s:
            late.append(now)
            if len(late) == LAG_SAMPLES and now - late[0] <= LAG_WINDOW_S:
                reason = "lag"
        arrival, self._arrival_excess = self._arrival_excess, 0.0
        if reason is None and max(self.oldest_pending_age(now), arrival) > self._age_limit_s:
            reason = "message_age"
        limit = self._cpu_wait_limit
        if reason is None and limit is not None and cpu_wait is not None and cpu_wait > limit:
            reason = "cpu_wait"
        if reason is not None:
            if self.reason is None:
                log.warning(
                    "falling behind (%s; loop lag %.0f ms, oldest unanswered message %.0f ms, "
                    "latest arrival %.0f ms late, waiting for a CPU %.0f%% of the time): "
                    "shedding tenants above their fair share",
                    reason,
                    lag_s * 1000.0,
                    self.oldest_pending_age(now) * 1000.0,
                    arrival * 1000.0,
                    100.0 * (cpu_wait or 0.0),
                )
            self._last_over = now
            self.reason = reason
        elif self._last_over is not None and now - self._last_over >= self._recover_s:
            log.info("caught up: shedding stopped")
            self._last_over = None
            self.reason = None
        if self.reason is None:
            self.shed_set = frozenset()
        elif not self.shed_set:  # the episode's first sample, or nobody was over until now
            self.shed_set = frozenset(self._over_share())
        else:
            self.shed_set = self.shed_set | (self._over_share() & self._queued())
        return self.reason is not None

    def sheds(self, tenant: str) -> bool:
        """Is a new request of this tenant shed now?"""
        return self.reason is not None and tenant in self.shed_set

    def describe(self) -> dict[str, object]:
        """The state for the status page: whether it sheds, why and whom, the latest readings
        and the thresholds they are held against."""
        settings = self.settings
        return {
            "enabled": settings.enabled,
            "shedding": self.reason is not None,
            "reason": self.reason,
            "shed_tenants": sorted(self.shed_set),
            "lag_ms": round(self.lag_s * 1000.0, 1),
            "cpu_wait": None if self.cpu_wait is None else round(self.cpu_wait, 3),
            "lag_threshold_ms": settings.lag_threshold_ms,
            "cpu_wait_fraction": settings.cpu_wait_fraction,
        }


class LagMonitor:
    """The asyncio side: samples the event-loop lag every `interval_ms` (a loop timer, no task)
    and feeds the detector; `on_sample` runs after each sample (the gateway sheds queued
    requests there). While `idle()` says nothing is queued or in flight and the detector is
    quiet, the next sample is IDLE_INTERVAL_S away, or sooner on the detector's `activity`."""

    def __init__(
        self,
        detector: OverloadDetector,
        on_sample: Callable[[bool], None],
        idle: Callable[[], bool] = lambda: False,
    ) -> None:
        self.detector = detector
        self._on_sample = on_sample
        self._idle = idle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._interval_s = detector.settings.interval_ms / 1000.0
        self._cpu_wait: CpuWait | None = None
        """The loop thread's wait for a CPU, read at each sample (made in `start`, on it)."""
        self.next_sample_at = 0.0
        """When (loop time) the next sample is due; the lag is measured from it."""

    @property
    def idle(self) -> bool:
        """Sampling at IDLE_INTERVAL_S, waiting for activity."""
        return self.detector.wake is not None

    def start(self) -> None:
        if self._timer is None and self.detector.enabled:
            self._loop = asyncio.get_running_loop()
            self._interval_s = self.detector.settings.interval_ms / 1000.0
            self._cpu_wait = CpuWait(schedstat_path())
            self._schedule(self._interval_s)

    async def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.detector.wake = None

    def _schedule(self, delay_s: float) -> None:
        assert self._loop is not None
        self.next_sample_at = self._loop.time() + delay_s
        self._timer = self._loop.call_at(self.next_sample_at, self._sample)

    def _sample(self) -> None:
        assert self._loop is not None
        lag = max(0.0, self._loop.time() - self.next_sample_at)
        detector = self.detector
        cpu_wait = None
        if self._cpu_wait is not None and detector.settings.cpu_wait_fraction is not None:
            cpu_wait = self._cpu_wait.sample()
        try:
            self._on_sample(detector.observe(lag, cpu_wait))
            quiet = detector.quiet and self._idle()
        except Exception:
            log.exception("overload sample failed")
            quiet = False
        if quiet:
            detector.wake = self._wake
            self._schedule(max(IDLE_INTERVAL_S, self._interval_s))  # never faster than busy
        else:
            detector.wake = None
            self._schedule(self._interval_s)

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._schedule(self._interval_s)
