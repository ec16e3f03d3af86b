"""The queue's Prometheus metrics: what a scrape reads from the database, and
the one thing measured in the processes themselves.

Several processes serve the queue at once (the daemon with its reaper and
embedded worker, and every listener process), and a scraper reaches only one
of them per scrape. So nothing a scrape answers may depend on which one:

* the gauges (`apiary_jobs`, `apiary_queue_oldest_age_seconds`,
  `apiary_workers`, `apiary_worker_active_jobs`) are read from the database
  at scrape time by `QueueCollector`;
* the two counters are derived from durable rows too, not counted in memory:
  every claim inserts one attempt row and every lease that ends expired
  leaves its attempt `expired`. Claims happen in the listener processes and
  in the daemon (the embedded worker), expiries in the daemon's reaper and in
  the listener (a superseded session, a claim nobody received), so a
  process-local counter would need every one of those processes to share a
  directory; the rows are exact, survive restarts and cost a count per
  scrape, as the job gauges do (jobs are never deleted, so the counts only
  grow);
* `apiary_attempt_heartbeat_seconds`, how long handling a heartbeat takes, is
  known only in the process that handled it: that histogram uses
  prometheus-client's multiprocess mode, files in one directory shared by the
  daemon and its listener (`enable_multiprocess`, cleaned at every start by
  `apiary run`), merged at scrape time by every process alike.
"""

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from django.db.models import Count, Min
from prometheus_client import CollectorRegistry, Histogram, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from . import conf
from .clock import get_clock
from .models import Attempt, AttemptState, Job, JobState
from .selectors.workers import HEALTHS, active_jobs, worker_health, workers_all

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own name for the directory

# Every metric name Apiary exports (examples/monitoring is checked against it).
JOBS = "apiary_jobs"
OLDEST = "apiary_queue_oldest_age_seconds"
WORKERS = "apiary_workers"
WORKER_ACTIVE = "apiary_worker_active_jobs"
EXPIRIES = "apiary_lease_expiries"  # exposed with prometheus' _total suffix
CLAIMS = "apiary_claims"
HEARTBEAT = "apiary_attempt_heartbeat_seconds"
EXPORTED = (
    JOBS, OLDEST, WORKERS, WORKER_ACTIVE, f"{EXPIRIES}_total", f"{CLAIMS}_total",
    *(f"{HEARTBEAT}{suffix}" for suffix in ("_bucket", "_sum", "_count")),
)  # fmt: skip

# A heartbeat is one short transaction; anything past a second is a database in trouble.
HEARTBEAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_local = CollectorRegistry(auto_describe=True)  # this process's own metrics, when not in multiprocess mode
_lock = threading.Lock()
_heartbeat: Histogram | None = None


class QueueCollector:
    """The queue as the database has it now; every process answers alike."""

    def describe(self):
        return []  # nothing to check at registration: collect() queries the database

    def collect(self):
        now = get_clock().now()
        jobs = GaugeMetricFamily(JOBS, "Jobs by state, project and pool.", labels=["state", "project", "pool"])
        rows = Job.objects.values("state", "project", "pool").annotate(n=Count("id")).order_by("state", "project", "pool")
        counts = {(row["project"], row["pool"] or ""): {} for row in rows}
        for row in rows:
            counts[(row["project"], row["pool"] or "")][row["state"]] = row["n"]
        for (project, pool), by_state in counts.items():
            for state in JobState.values:  # 0 rather than absent: a rule comparing with an hour ago needs both
                jobs.add_metric([state, project, pool], by_state.get(state, 0))
        yield jobs

        oldest = Job.objects.filter(state=JobState.QUEUED, available_at__lte=now).aggregate(at=Min("available_at"))["at"]
        yield GaugeMetricFamily(
            OLDEST,
            "Seconds the longest-waiting claimable queued job has been claimable (0 when none is).",
            value=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
        )

        workers = workers_all()  # a forgotten worker is no longer the operator's concern
        timeout = conf.current().worker_timeout
        health = GaugeMetricFamily(WORKERS, "Registered workers by health.", labels=["health"])
        by_health = dict.fromkeys(HEALTHS, 0)
        for worker in workers:
            by_health[worker_health(worker, now=now, timeout=timeout)] += 1
        for name, n in by_health.items():
            health.add_metric([name], n)
        yield health

        live = active_jobs(now=now)
        active = GaugeMetricFamily(WORKER_ACTIVE, "Live attempts per registered worker.", labels=["worker"])
        for worker in workers:
            active.add_metric([worker.worker_id], live.get(worker.worker_id, 0))
        yield active

        yield CounterMetricFamily(CLAIMS, "Jobs claimed (attempts started), since the database was made.", value=Attempt.objects.count())
        yield CounterMetricFamily(
            EXPIRIES,
            "Attempts that ended expired (lease ran out, worker registered again, claim never received).",
            value=Attempt.objects.filter(state=AttemptState.EXPIRED).count(),
        )


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def enable_multiprocess(directory: Path) -> None:
    """Process-local metrics from now on go to files in `directory`, for this
    process and (through the environment) every process it starts.

    prometheus-client decides between memory and files when it is first
    imported, from the environment; the daemon learns its state directory only
    later, so it switches here — before any metric exists (they are made on
    first use) — as prometheus-client's own value class allows."""
    with _lock:
        if _heartbeat is not None:
            raise RuntimeError("enable_multiprocess must come before any metric is recorded")
        os.environ[MULTIPROC_ENV] = str(directory)
        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.MultiProcessValue()


def _histogram() -> Histogram:
    global _heartbeat
    if _heartbeat is None:
        with _lock:
            if _heartbeat is None:
                _heartbeat = Histogram(
                    HEARTBEAT,
                    "Time to handle an attempt heartbeat (the lease extension's transaction), in seconds.",
                    buckets=HEARTBEAT_BUCKETS,
                    registry=_local,
                )
    return _heartbeat


def timed_heartbeat(fn: Callable) -> Callable:
    """Observe how long each call of `fn` (a heartbeat service, its commit included) takes, refused or not."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _histogram().observe(time.perf_counter() - started)

    return wrapper


def registry() -> CollectorRegistry:
    """What one scrape reads: the queue from the database, and the processes'
    own metrics (every process's files in multiprocess mode, else this one's)."""
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(QueueCollector())
    directory = multiprocess_dir()
    if directory is not None:
        MultiProcessCollector(scrape, path=directory)
    else:
        scrape.register(_LocalCollector())
    _histogram()  # present (all zero) before the first heartbeat
    return scrape


class _LocalCollector:
    def collect(self):
        return _local.collect()
