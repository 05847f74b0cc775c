"""When the emulated engine's next step starts: on the model's timeline, not the host's.

In vLLM V1 the engine core is a process of its own: while work lasts, its steps follow one
another at the model's pace, whatever the API server is doing. The emulator runs its step loop
and its HTTP server in one event loop, so each step would otherwise start when the loop gets
round to it: writing 20-30 streams' chunks and parsing new requests delays each wake-up by
~1.2 ms on average under kvwarden's workload (~15 ms steps). So a step that follows another
starts where the previous one ended, and the host's lag only delays when its tokens are
delivered, as a busy API server delays a real engine's output. With the engine on a core of
its own the difference is small (quiet P99 beside the flooder 53.6 -> 50.8 ms, the median
unchanged: `extproc bench engine-clock`, docs/calibration.md); it grows with the host's load.

Causality is kept: a request that arrived after the previous step ended cannot join a step that
starts before it arrived, so such a step starts at that arrival instead (never earlier than the
engine could have seen it; at most as late as the host's own timing).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["STEP_CLOCKS", "StepClock", "StepTimeline"]

StepClock = Literal["model", "wake"]
STEP_CLOCKS: tuple[StepClock, ...] = ("model", "wake")


class StepTimeline:
    """The start time of each step: the previous step's end while work continues."""

    __slots__ = ("_last_arrival", "_previous_end")

    def __init__(self) -> None:
        self._previous_end: float | None = None
        self._last_arrival = float("-inf")

    def arrived(self, at: float) -> None:
        """A request reached the core at `at` (the clock the step loop uses)."""
        self._last_arrival = max(self._last_arrival, at)

    def idle(self) -> None:
        """The engine ran out of work: the next step starts when it is taken."""
        self._previous_end = None

    def start(self, now: float) -> float:
        """The start of the step taken at `now`."""
        previous = self._previous_end
        if previous is None or previous > now:
            return now
        return max(previous, min(self._last_arrival, now))

    def ended(self, end: float) -> None:
        """The step just run ends at `end` (its start plus the model's duration)."""
        self._previous_end = end
