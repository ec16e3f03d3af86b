"""The queue's only source of time.

Lease math reads `now()` from the injected clock and nowhere else, so tests
move a `FrozenClock` instead of sleeping, and the control plane's clock is the
single lease authority (workers get durations, never timestamps to compare).
"""

import datetime as dt
import threading
from typing import Protocol


class Clock(Protocol):
    def now(self) -> dt.datetime: ...


class SystemClock:
    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)


class FrozenClock:
    """A clock that only moves when told to; thread-safe for tests with a worker thread."""

    def __init__(self, start: dt.datetime | None = None):
        self._now = start or dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        self._lock = threading.Lock()

    def now(self) -> dt.datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> dt.datetime:
        with self._lock:
            self._now += dt.timedelta(seconds=seconds)
            return self._now


_clock: Clock = SystemClock()


def get_clock() -> Clock:
    return _clock


def set_clock(clock: Clock) -> Clock:
    """Install `clock` for every service call; returns the previous one."""
    global _clock
    previous, _clock = _clock, clock
    return previous


def now() -> dt.datetime:
    return _clock.now()
