"""The smallest replica count that passes a monotone test, with few tests.

Galloping from an estimate (n, n+1, n+3, n+7, ... up, or n-1, n-3, n-7, ... down) brackets the
answer in O(log distance) tests, then bisection finds it; every count is tested at most once.
"""

from __future__ import annotations

from collections.abc import Callable


def smallest_passing(
    passes: Callable[[int], bool], start: int = 1, maximum: int = 1024
) -> int | None:
    """The least n in [1, maximum] with passes(n), assuming passes is monotone; None if even
    `maximum` fails."""
    if maximum < 1:
        raise ValueError("maximum must be >= 1")
    cache: dict[int, bool] = {}

    def test(n: int) -> bool:
        if n not in cache:
            cache[n] = passes(n)
        return cache[n]

    start = min(max(1, start), maximum)
    step = 1
    if test(start):
        low, high = 0, start  # low fails (0 replicas always fail), high passes
        while True:
            n = high - step
            if n <= low:
                break
            if test(n):
                high = n
                step *= 2
            else:
                low = n
                break
    else:
        low = start
        while True:
            n = min(low + step, maximum)
            if n == low:
                return None
            if test(n):
                high = n
                break
            low = n
            step *= 2
    while high - low > 1:
        middle = (low + high) // 2
        if test(middle):
            high = middle
        else:
            low = middle
    return high
