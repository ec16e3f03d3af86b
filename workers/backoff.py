"""The one retry policy of the worker side: capped exponential backoff with
full jitter ("Exponential Backoff and Jitter", AWS Architecture Blog).

After n failures in a row the wait is uniformly random in
[0, min(cap, base * 2**(n-1))]: the ceiling doubles up to the cap, and the
randomness spreads a fleet that failed together (the control plane
restarted) over the whole window instead of bringing it back in lockstep. A
success resets it.

`Retry-After` (delta-seconds only: an HTTP date would mean comparing this
machine's clock with the control plane's, which the worker never does) is a
floor: the wait is never shorter than the control plane asked. A fleet told
the same second would come back together, so the floor is spread too, over
[retry_after, 1.5 * retry_after]. A Retry-After above the cap counts as the
cap: a hostile or broken answer cannot park a worker for hours.

Retrying belongs to the caller that knows the call (the claim loop, the
finish of a job, registration); the HTTP transport tries once unless asked
otherwise, so two layers never multiply, and a log line naming the delay is
the delay.
"""

import random
from collections.abc import Callable


class Backoff:
    def __init__(self, *, base: float, cap: float, rand: Callable[[], float] = random.random):
        if not 0 < base <= cap:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={base!r} cap={cap!r}")
        self.base = base
        self.cap = cap
        self.rand = rand  # uniform in [0, 1); tests pass a fixed one
        self.failures = 0  # in a row, since the last success

    def failed(self, retry_after: float | None = None) -> float:
        """Count a failure; the seconds to wait before the next try."""
        ceiling = min(self.cap, self.base * 2 ** min(self.failures, 64))  # no overflow after a long outage
        self.failures += 1
        delay = self.rand() * ceiling
        if retry_after is not None and retry_after > 0:
            floor = min(retry_after, self.cap)
            delay = max(delay, min(self.cap, floor * (1 + self.rand() / 2)))  # spread, but never past the cap
        return delay

    def succeeded(self) -> None:
        self.failures = 0


def retry_after_of(value: str | None) -> float | None:
    """A Retry-After header's delta-seconds, or None (absent, a date, nonsense)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None
