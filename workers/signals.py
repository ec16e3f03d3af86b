"""SIGINT and SIGTERM for a process that runs a worker runtime.

The handler only records the signal: it runs on the main thread between any
two bytecodes, possibly while that thread holds a lock the runtime needs.
The process's own loop calls `act()`, which does what the signals asked: the
first drains (stop claiming, let active jobs finish), the second stops the
running jobs (they finish `cancelled`).
"""

import logging
import signal
import threading

log = logging.getLogger("apiary.worker")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Signals:
    def __init__(self):
        self.count = 0
        self.acted = 0
        self.received = threading.Event()
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.received.set()

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def act(self, runtime) -> None:
        """Apply the signals received so far to `runtime` (None: nothing to drain)."""
        if self.acted < 1 <= self.count:
            self.acted = 1
            log.info("signal: draining (a second signal stops running jobs)")
            if runtime is not None:
                runtime.request_drain("signal; a second signal stops running jobs")
        if self.acted < 2 <= self.count:
            self.acted = 2
            if runtime is not None:
                runtime.cancel_all("second signal")
