"""Long-poll claims: claim, and with `wait` > 0 and nothing claimable, claim
again after short jittered sleeps until something is claimed or `wait`
seconds pass. Shared by the protocol's `POST claims` and the embedded
worker's in-process transport. Each claim is its own short transaction:
nothing is held while sleeping, so other claimers, finishes and enqueues
proceed meanwhile."""

import random
import time

from django.conf import settings

from jobqueue import services
from jobqueue.types import Claim

DEFAULT_POLL_INTERVAL = 0.3  # seconds between claim attempts of a long-poll, before jitter

# Indirections the long-poll tests replace; production uses the real ones.
_sleep = time.sleep
_monotonic = time.monotonic
_jitter = random.Random()


def poll_interval() -> float:
    """Seconds between claim attempts while long-polling (settings.APIARY_CLAIM_POLL_INTERVAL)."""
    return float(getattr(settings, "APIARY_CLAIM_POLL_INTERVAL", DEFAULT_POLL_INTERVAL))


def claim_with_wait(*, worker_id: str, session: str, max_jobs: int, wait: float) -> list[Claim]:
    """Claim; with `wait` > 0 and nothing claimable, claim again after short
    jittered sleeps until something is claimed or `wait` seconds pass. Each
    claim is its own short transaction: nothing is held while sleeping, so
    other claimers, finishes and enqueues proceed meanwhile."""
    deadline = _monotonic() + wait
    while True:
        claims = services.jobs_claim(worker_id=worker_id, session=session, max_jobs=max_jobs)
        remaining = deadline - _monotonic()
        if claims or remaining <= 0:
            return claims
        _sleep(min(remaining, poll_interval() * _jitter.uniform(0.7, 1.5)))
