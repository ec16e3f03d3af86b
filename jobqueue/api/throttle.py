"""A budget of claim calls per worker id: a token bucket in each listener process.

A claim call is the protocol's one expensive request (a write transaction
even when it finds nothing), so one worker id, or one stolen credential,
sending claims as fast as it can would slow every other worker's heartbeats.
Each id may send `claim_burst` claims at once and `claim_rate` per second
after that (settings.queue; 0 turns the budget off); a claim over budget is
answered 429 `rate_limited` with `Retry-After` and changes nothing. An honest
worker long-polls, so it sends about one claim per job or per `wait`.

The bucket is per process (gunicorn runs several): a worker spread over N
listener processes gets up to N times the budget, which still bounds it.
Only authenticated calls reach it, keyed by the credential's own id, so a
caller cannot spend another worker's budget.
"""

import math
import threading
import time

from jobqueue import conf
from jobqueue.exceptions import RateLimited

MAX_TRACKED = 10_000  # ids remembered; beyond that, full buckets are dropped first


class Buckets:
    def __init__(self, timer=time.monotonic):
        self.timer = timer
        self._lock = threading.Lock()
        self._level: dict[str, tuple[float, float]] = {}  # id -> (tokens, at)

    def charge(self, worker_id: str) -> None:
        """Spend one claim of `worker_id`'s budget, or raise RateLimited."""
        cfg = conf.current()
        rate, burst = cfg.claim_rate, float(cfg.claim_burst)
        if rate <= 0:
            return
        now = self.timer()
        with self._lock:
            tokens, at = self._level.get(worker_id, (burst, now))
            tokens = min(burst, tokens + (now - at) * rate)
            if tokens < 1.0:
                self._level[worker_id] = (tokens, now)
                wait = (1.0 - tokens) / rate
                raise RateLimited(
                    f"worker {worker_id!r} sent more than {rate:g} claims per second "
                    f"(settings.queue.claim_rate); retry in {wait:.2f}s",
                    retry_after=wait,
                    worker_id=worker_id,
                )
            self._level[worker_id] = (tokens - 1.0, now)
            if len(self._level) > MAX_TRACKED:
                self._forget_full(now, rate, burst)

    def _forget_full(self, now: float, rate: float, burst: float) -> None:
        full = [k for k, (tokens, at) in self._level.items() if tokens + (now - at) * rate >= burst]
        for key in full:
            del self._level[key]

    def clear(self) -> None:
        with self._lock:
            self._level.clear()


claims = Buckets()


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds: round up, so a client that honours it is never early."""
    return str(max(1, math.ceil(seconds)))
