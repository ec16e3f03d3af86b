"""The control plane's own loop: poll sources, dispatch, reap expired leases,
materialise spawn records into child tasks (workflows.spawning).

`run_once()` does one round and returns; `apiary run` calls it in a loop next
to the embedded worker, and tests call it directly.

Each source is read in a thread of its own (one poll in flight per source),
because a command source may run for up to max(60 s, poll_interval) and the
loop must keep reaping leases meanwhile. The thread only reads the source;
`run_once()` takes its items when it is done and writes tasks and jobs from
the loop's thread, so all database work stays on one connection. `poll()`
does the same synchronously, for tests and one-off calls.
"""

import dataclasses
import logging
import threading
import time

from django.db import DatabaseError, connections

from jobqueue import conf
from jobqueue import services as queue
from jobqueue.clock import Clock, get_clock
from jobqueue.exceptions import Unavailable
from jobqueue.models import Job, JobState
from jobqueue.selectors import BLOCKED_LIMIT, blocked_reasons
from jobqueue.types import LOG_RETENTION

from . import reaperbeat, services, sources, spawning
from .config import Config
from .models import Task

log = logging.getLogger("apiary.controlplane")

ITEM_KEY_MAX = Task._meta.get_field("item_key").max_length
KEY_PREVIEW = 80  # characters of an item key quoted in a log line
FORGET_INTERVAL = 600.0  # seconds between two looks for forgettable workers


@dataclasses.dataclass
class _Poll:
    """One source poll running in its thread; `items` or `error` once it ended."""

    thread: threading.Thread
    items: list[sources.Item] | None = None
    error: str | None = None


def _preview(key: str) -> str:
    return key[:KEY_PREVIEW] + ("…" if len(key) > KEY_PREVIEW else "")


class ControlPlane:
    def __init__(self, *, config: Config, clock: Clock | None = None, reap_interval: float = 1.0, committer=None):
        self.config = config
        self.clock = clock
        self.committer = committer  # the embedded worker's (jobqueue.groupcommit): dispatch writes through it
        self.reap_interval = reap_interval
        self.next_poll = dict.fromkeys(config.sources, 0.0)
        self.polled: set[str] = set()  # polled at least once, successfully or not
        self.next_reap = 0.0
        self.next_forget = 0.0
        self._failed: set[str] = set()  # whose last poll failed
        self._running: dict[str, _Poll] = {}

    def run_once(self) -> None:
        """Take the items of finished polls, start the polls that are due, reap.
        Never waits for a source."""
        self.collect()
        now = time.monotonic()
        for source_id, due in self.next_poll.items():
            if now >= due and source_id not in self._running:
                self._running[source_id] = self._start(source_id)
        if now >= self.next_reap:
            self.reap()
            self.beat()
            self.materialise()
            self.next_reap = now + self.reap_interval
        if now >= self.next_forget:
            self.forget()
            self.prune_logs()
            self.next_forget = now + FORGET_INTERVAL

    def collect(self) -> int:
        """Dispatch what the finished background polls found; returns the jobs created."""
        created = 0
        for source_id, running in list(self._running.items()):
            if running.thread.is_alive():
                continue
            del self._running[source_id]
            self.next_poll[source_id] = time.monotonic() + self.config.sources[source_id].poll_interval
            created += self._settle(source_id, running.items, running.error)
        return created

    def poll(self, source_id: str) -> int:
        """Poll one source now, in this thread, and dispatch what is new; returns
        the jobs created. A failing source is logged and tried again next
        interval; its known tasks are untouched."""
        try:
            items, error = self._read(source_id), None
        except sources.SourceError as exc:
            items, error = None, str(exc)
        return self._settle(source_id, items, error)

    def failed_sources(self) -> set[str]:
        """Sources whose last poll failed (none of their items is new since)."""
        return set(self._failed)

    def _read(self, source_id: str) -> list[sources.Item]:
        # A command source runs in the config's folder, wherever the daemon was started.
        return sources.poll(self.config.sources[source_id], cwd=self.config.path.parent)

    def _start(self, source_id: str) -> _Poll:
        def run() -> None:
            try:
                running.items = self._read(source_id)
            except sources.SourceError as exc:
                running.error = str(exc)
            except Exception as exc:
                # Nobody is there to catch it: a bug in a source must not kill the source for good.
                log.exception("source %s: poll raised", source_id)
                running.error = f"poll raised {exc!r}"
            finally:
                connections.close_all()  # this thread's own, if anything in it opened one

        running = _Poll(thread=threading.Thread(target=run, name=f"poll-{source_id}", daemon=True))
        running.thread.start()
        return running

    def _settle(self, source_id: str, items: list[sources.Item] | None, error: str | None) -> int:
        """Record how a poll ended and dispatch its items. A poll that failed
        counts as polled, so `--until-idle` does not wait for a source that
        fails every time (the daemon warns about `failed_sources()` instead)."""
        if error is not None:
            interval = self.config.sources[source_id].poll_interval
            log.warning("source %s: poll failed, will retry in %ss: %s", source_id, interval, error)
            self._failed.add(source_id)
            self.polled.add(source_id)
            return 0
        created = self._dispatch(source_id, items or [])
        self._failed.discard(source_id)
        self.polled.add(source_id)
        return created

    def _dispatch(self, source_id: str, items: list[sources.Item]) -> int:
        """Tasks and jobs for the items, a batch per transaction (services.items_dispatch).
        A batch the database cannot take is tried again item by item, each in its own
        transaction, so one bad item is logged and skipped, leaving nothing of itself,
        and the others go on (it is tried again next poll)."""
        source = self.config.sources[source_id]
        storable = [item for item in items if self._storable(source_id, item)]
        created = 0
        for start in range(0, len(storable), services.BATCH):
            batch = storable[start : start + services.BATCH]
            if len(batch) == 1:
                created += self._dispatch_one(source, batch[0])
                continue
            try:
                created += len(self._items_dispatch(source, batch))
            except (DatabaseError, Unavailable, ValueError) as exc:
                log.info("source %s: a batch of %d items failed (%s); dispatching them one by one", source_id, len(batch), exc)
                created += sum(self._dispatch_one(source, item) for item in batch)
        return created

    def _storable(self, source_id: str, item: sources.Item) -> bool:
        if len(item.key) <= ITEM_KEY_MAX:
            return True
        log.warning(
            "source %s: skipping item %r: its id is %d characters, a task key holds at most %d",
            source_id, _preview(item.key), len(item.key), ITEM_KEY_MAX,
        )  # fmt: skip
        return False

    def _dispatch_one(self, source, item: sources.Item) -> int:
        try:
            return len(self._items_dispatch(source, [item]))
        except (DatabaseError, Unavailable, ValueError) as exc:
            log.error("source %s: skipping item %r: cannot store it: %s", source.id, _preview(item.key), exc)
            return 0

    def _items_dispatch(self, source, items: list[sources.Item]) -> list[Job]:
        return services.items_dispatch(
            config=self.config, source=source, items=items, clock=self.clock, committer=self.committer
        )

    def reap(self) -> int:
        expired = queue.leases_expire(clock=self.clock)
        for attempt in expired:
            log.warning(
                "expiry: job %s attempt %s (#%s) on worker %s: lease ran out; job now %s",
                attempt.job_id, attempt.pk, attempt.number, attempt.worker_id, attempt.job.state,
            )
        return len(expired)

    def beat(self) -> None:
        """Record that the reaper ran (workflows.reaperbeat, read by /healthz)."""
        try:
            reaperbeat.record(self.config.state_dir, (self.clock or get_clock()).now())
        except OSError as exc:  # the loop goes on; /healthz reports the reaper as not running
            log.warning("cannot record the reaper's beat in %s: %s", reaperbeat.path_of(self.config.state_dir), exc)

    def materialise(self) -> int:
        """Done spawn records into child tasks and their jobs, a bounded batch
        (spawning.BATCH); returns the records materialised."""
        done = spawning.spawns_materialise(config=self.config, clock=self.clock)
        if done:
            log.info("spawn: materialised %d spawn record(s)", done)
        return done

    def forget(self) -> int:
        """Drop registrations silent for `forget_workers_after` that never held an attempt."""
        forgotten = queue.workers_forget(older_than=conf.current().forget_workers_after, clock=self.clock)
        if forgotten:
            log.info("forgot %d worker(s) silent for settings.queue.forget_workers_after that never ran a job", forgotten)
        return forgotten

    def prune_logs(self) -> int:
        """Drop the step logs of jobs that finished more than LOG_RETENTION ago (a batch a call)."""
        pruned = queue.logs_prune(older_than=LOG_RETENTION, clock=self.clock)
        if pruned:
            log.info("pruned the step logs of %d stream(s) of jobs finished more than %gs ago", pruned, LOG_RETENTION)
        return pruned

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
        """Every source polled at least once (a failed poll counts: see
        `failed_sources()`), no job queued or leased and no spawn record
        waiting to become tasks (its children are work still to come)."""
        return (
            self.polled >= set(self.config.sources)
            and not Job.objects.filter(state__in=(JobState.QUEUED, JobState.LEASED)).exists()
            and not spawning.spawns_pending()
        )
