"""The control plane's own loop: poll sources, dispatch, reap expired leases.

`run_once()` does one round and returns; `apiary run` calls it in a loop next
to the embedded worker, and tests call it directly.
"""

import logging
import time

from jobqueue import services as queue
from jobqueue.clock import Clock
from jobqueue.models import Job, JobState
from jobqueue.selectors import BLOCKED_LIMIT, blocked_reasons

from . import services, sources
from .config import Config

log = logging.getLogger("apiary.controlplane")


class ControlPlane:
    def __init__(self, *, config: Config, clock: Clock | None = None, reap_interval: float = 1.0):
        self.config = config
        self.clock = clock
        self.reap_interval = reap_interval
        self.next_poll = dict.fromkeys(config.sources, 0.0)
        self.polled: set[str] = set()
        self.next_reap = 0.0

    def run_once(self) -> None:
        now = time.monotonic()
        for source_id, due in self.next_poll.items():
            if now >= due:
                self.poll(source_id)
                self.next_poll[source_id] = time.monotonic() + self.config.sources[source_id].poll_interval
        if now >= self.next_reap:
            self.reap()
            self.next_reap = now + self.reap_interval

    def poll(self, source_id: str) -> int:
        """Poll one source and dispatch what is new; returns the jobs created. A
        failing source is logged and tried again next interval; its known
        tasks are untouched."""
        source = self.config.sources[source_id]
        try:
            # A command source runs in the config's folder, wherever the daemon was started.
            items = sources.poll(source, cwd=self.config.path.parent)
        except sources.SourceError as exc:
            log.warning("source %s: poll failed, will retry in %ss: %s", source_id, source.poll_interval, exc)
            return 0
        created = 0
        for item in items:
            task, _ = services.task_sync(source=source, item=item, clock=self.clock)
            created += len(services.dispatch(config=self.config, task=task, workflows=source.workflows, clock=self.clock))
        self.polled.add(source_id)
        return created

    def reap(self) -> int:
        expired = queue.leases_expire(clock=self.clock)
        for attempt in expired:
            log.warning(
                "expiry: job %s attempt %s (#%s) on worker %s: lease ran out; job now %s",
                attempt.job_id, attempt.pk, attempt.number, attempt.worker_id, attempt.job.state,
            )
        return len(expired)

    def stuck(self) -> list[dict]:
        """Queued jobs that can never run as things stand: nothing is leased and
        every queued job is blocked for a reason that waiting will not cure
        (no worker in its pool, a missing label or runner, a pin to a worker
        that is gone…). [] when any job may still run."""
        if Job.objects.filter(state=JobState.LEASED).exists():
            return []
        queued = Job.objects.filter(state=JobState.QUEUED).count()
        if not queued or queued > BLOCKED_LIMIT:
            return []
        blocked = blocked_reasons()
        if len(blocked) < queued or any(b["reason"].startswith("not before") for b in blocked):
            return []
        return blocked

    def idle(self) -> bool:
        """Every source polled at least once and no job queued or leased."""
        return self.polled >= set(self.config.sources) and not Job.objects.filter(
            state__in=(JobState.QUEUED, JobState.LEASED)
        ).exists()
