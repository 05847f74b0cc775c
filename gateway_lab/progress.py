"""Progress of the lab's long work (`extproc simulate`, `simulate plan`, `extproc bench`) with an
ETA. On a terminal: one line on stderr, rewritten in place at most once per interval. In a pipe
or a CI log: one line per phase and nothing in between, so logs stay short.

Work is measured in units the caller picks (requests resolved, arms run, pools sized); the ETA
assumes the rest goes at the average pace so far: elapsed * (total - done) / done.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

Clock = Callable[[], float]


def eta_seconds(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the pace so far; None before any work is done (no pace yet)."""
    if total <= 0 or done >= total:
        return 0.0
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed * (total - done) / done


def format_duration(seconds: float | None) -> str:
    """`m:ss`, or `h:mm:ss` from an hour; `?` when unknown."""
    if seconds is None:
        return "?"
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _number(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


class Progress:
    """One long job: `phase` when a step starts, `update` as work gets done, `finish` at the end.

    `interactive` defaults to whether `stream` is a terminal; `clock` is injectable for tests.
    """

    def __init__(
        self,
        label: str,
        total: float,
        *,
        unit: str = "",
        stream: TextIO | None = None,
        clock: Clock = time.monotonic,
        interactive: bool | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.interval_s = interval_s
        self.started = clock()
        self.done = 0.0
        self.phase_name = ""
        self.phases = 0
        self._detail = ""
        self._drawn_at: float | None = None
        self._line_open = False

    def elapsed(self) -> float:
        return self.clock() - self.started

    def eta(self) -> float | None:
        return eta_seconds(self.done, self.total, self.elapsed())

    def phase(self, name: str, done: float | None = None) -> None:
        """A new step. In a pipe this is the only line printed until `finish`."""
        if done is not None:
            self.done = done
        self.phase_name = name
        self.phases += 1
        if self.interactive:
            self._draw(self._detail)
        else:
            self._print(f"[{self.label}] {name} ({self._figures()})")

    def update(self, done: float, detail: str = "") -> None:
        """Work done so far; redraws the terminal line (throttled), silent in a pipe."""
        self.done = done
        self._detail = detail
        if not self.interactive:
            return
        now = self.clock()
        if self._drawn_at is not None and now - self._drawn_at < self.interval_s:
            return
        self._draw(detail)

    def note(self, message: str) -> None:
        """A line that stays (a warning, a result) above the live line, in a pipe too."""
        self._print(message)
        if self.interactive and self._drawn_at is not None:
            self._draw(self._detail)

    def finish(self, summary: str = "") -> None:
        """Ends the job with how long it took; on a terminal that line replaces the live one."""
        tail = f": {summary}" if summary else ""
        self._print(f"[{self.label}] done in {format_duration(self.elapsed())}{tail}")
        self._drawn_at = None

    def status(self) -> str:
        """The live line's text (without the terminal control characters)."""
        phase = f" {self.phase_name}" if self.phase_name else ""
        return f"[{self.label}]{phase}  {self._figures()}"

    def _figures(self) -> str:
        share = f"{100.0 * min(1.0, self.done / self.total):.0f}% " if self.total > 0 else ""
        unit = f" {self.unit}" if self.unit else ""
        count = f"{_number(self.done)}/{_number(self.total)}{unit}"
        return (
            f"{share}{count}, elapsed {format_duration(self.elapsed())}, "
            f"ETA {format_duration(self.eta())}"
        )

    def _draw(self, detail: str) -> None:
        text = self.status() + (f"  {detail}" if detail else "")
        width = shutil.get_terminal_size(fallback=(120, 24)).columns
        # Cut to the terminal's width: a wrapped line could not be rewritten in place.
        self.stream.write("\r" + text[: max(10, width - 1)] + "\x1b[K")
        self.stream.flush()
        self._drawn_at = self.clock()
        self._line_open = True

    def _print(self, line: str) -> None:
        if self._line_open:  # overwrite the live line, which the caller redraws if it goes on
            self.stream.write("\r" + line + "\x1b[K\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._line_open = False
