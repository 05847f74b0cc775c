"""Run a program on a shorter CPU slice: the `-slice` arms of `extproc bench self-overload`.

`python -m gateway_lab.bench.cpu_slice US -- COMMAND [ARG...]` asks the kernel for a US
microsecond slice and execs COMMAND (the service, Envoy). Linux's EEVDF scheduler (6.12 and
later) lets any task ask for one, with no privilege: the task gets the same share of the CPU
in shorter turns, and on waking it runs sooner, as a shorter slice is an earlier deadline.
Threads and processes started after inherit it, across exec too. The question it answers:
does a message that wakes the service on a shared, busy core wait for whatever runs there to
use up its slice (1.4 ms by default with 2 CPUs)? Measured, it did not help the quiet tenant
and hurt under overload (docs/benchmarks.md, "`room` measured four times longer, and a
shorter CPU slice for the front"), so the service does not offer it.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Sequence

__all__ = ["current_slice_us", "set_cpu_slice"]

_SYS_SCHED_SETATTR = 314
_SYS_SCHED_GETATTR = 315
"""x86_64's syscall numbers (the only architecture this is tried on)."""
_SCHED_ATTR = struct.Struct("IIQiIQQQII")
"""struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes): size, policy, flags, nice, priority,
runtime, deadline, period, util_min, util_max. For SCHED_OTHER, runtime is the slice (ns)."""
_SCHED_OTHER = 0
MIN_SLICE_US = 100
MAX_SLICE_US = 100_000
"""The range the kernel accepts for a custom slice."""


def _syscall(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result: int = libc.syscall(number, *args)
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _supported() -> bool:
    return sys.platform == "linux" and os.uname().machine == "x86_64"


def current_slice_us() -> int | None:
    """The calling thread's slice in microseconds, or None where it cannot be read."""
    if not _supported():
        return None
    buffer = ctypes.create_string_buffer(_SCHED_ATTR.size)
    try:
        _syscall(_SYS_SCHED_GETATTR, 0, buffer, _SCHED_ATTR.size, 0)
    except OSError:
        return None
    return int(_SCHED_ATTR.unpack(buffer.raw)[5]) // 1000


def set_cpu_slice(microseconds: int) -> bool:
    """Ask for a `microseconds` slice for the calling thread (and what it starts from now on).
    False where the kernel or the platform cannot (the call then changed nothing); a kernel
    before EEVDF's custom slices accepts the call and ignores the slice, so read it back with
    `current_slice_us`. Keeps the thread's policy and nice value."""
    if not MIN_SLICE_US <= microseconds <= MAX_SLICE_US:
        raise ValueError(f"a slice is {MIN_SLICE_US}-{MAX_SLICE_US} us, not {microseconds}")
    if not _supported() or os.sched_getscheduler(0) != _SCHED_OTHER:
        return False
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    slice_ns = microseconds * 1000
    attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, _SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0, 0, 0)
    try:
        _syscall(_SYS_SCHED_SETATTR, 0, ctypes.create_string_buffer(attr, _SCHED_ATTR.size), 0)
    except OSError:
        return False
    return current_slice_us() == microseconds


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway_lab.bench.cpu_slice US -- COMMAND [ARG...]`: COMMAND on a US slice."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        usage = "usage: python -m gateway_lab.bench.cpu_slice MICROSECONDS -- COMMAND [ARG...]"
        print(usage, file=sys.stderr)
        return 2
    try:
        took = set_cpu_slice(int(args[0]))
    except ValueError as error:
        print(f"cpu_slice: {error}", file=sys.stderr)
        return 2
    if not took:
        print(f"cpu_slice: this system keeps its own slice for {args[2]}", file=sys.stderr)
    os.execvp(args[2], args[2:])


if __name__ == "__main__":
    raise SystemExit(main())
