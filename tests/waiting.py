"""The one way tests wait: poll a condition until it holds, against a deadline.

A deadline is not a timing assertion: a test waits only for something it
caused (a thread, a process, a row) and fails, naming what it waited for, if
that never happens. Tests never sleep a fixed time instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    condition: Callable[[], Any],
    *,
    timeout: float,
    what: str = "condition",
    step: float = 0.02,
    on_timeout: Callable[[], str] | None = None,
) -> Any:
    """Call `condition()` every `step` seconds until it returns something
    truthy, and return that. After `timeout` seconds raise AssertionError
    naming `what` and the timeout, followed by `on_timeout()` (extra
    diagnostics, e.g. a process's log tail) when given.

    `condition` may raise to fail the wait at once (e.g. when a process it
    waits on has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g}s waiting for {what}"
            if on_timeout is not None:
                message += f"\n{on_timeout()}"
            raise AssertionError(message)
        time.sleep(step)
