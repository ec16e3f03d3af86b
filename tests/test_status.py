"""The status document (PROTOCOL.md `GET status`) and the blocked-job reasons."""

import datetime as dt
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobqueue import services
from jobqueue.conf import Limits
from jobqueue.models import Job, JobState, Worker
from jobqueue.selectors import (
    BLOCKED_LIMIT,
    active_jobs,
    blocked_reasons,
    rfc3339,
    status_document,
    worker_can_claim,
    worker_health,
)
from jobqueue.types import Retry
from tests.factories import claim, enqueue, instance_id, make_task, register, task_id
from workflows.models import WorkflowInstance
from workflows.services import affinity_key

pytestmark = pytest.mark.django_db

RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")

WORKER_KEYS = {
    "worker_id",
    "pool",
    "labels",
    "capabilities",
    "capacity",
    "active_jobs",
    "health",
    "draining",
    "ready",
    "last_heartbeat_at",
}
ACTIVE_KEYS = {
    "job_id",
    "instance_id",
    "task_id",
    "workflow",
    "hook",
    "parent_instance_id",
    "worker_id",
    "attempt_number",
    "lease_expires_at",
    "cancel_requested",
}


def reasons() -> dict[int, str]:
    return {b["job_id"]: b["reason"] for b in status_document()["blocked"]}


# --------------------------------------------------------------------------- shape and values


def test_empty_document_has_every_key(clock):
    doc = status_document()
    assert doc == {
        "jobs": {"queued": 0, "leased": 0, "succeeded": 0, "failed": 0, "cancelled": 0},
        "workers": [],
        "active": [],
        "blocked": [],
    }


def test_document_shape_and_values(clock, queue_config):
    queue_config(lease_duration=30, worker_timeout=30)
    worker = register("w1", pool="build", labels=["linux"], capabilities=["docker"], capacity=2)
    running = enqueue(pool="build", labels=["linux"])
    done = enqueue(pool="build")
    [c1] = claim(worker)
    [c2] = claim(worker)
    assert {c1.job_id, c2.job_id} == {running.pk, done.pk}
    finished = c1 if c1.job_id == done.pk else c2
    live = c2 if finished is c1 else c1
    services.attempt_finish(attempt_id=finished.attempt_id, token=finished.token, outcome="succeeded")
    cancelled = enqueue()
    services.job_cancel(job_id=cancelled.pk)
    services.job_cancel(job_id=running.pk)  # leased: cancel requested only
    waiting = enqueue(pool="gpu")
    clock.advance(5)

    doc = status_document()

    assert set(doc) == {"jobs", "workers", "active", "blocked"}
    assert doc["jobs"] == {"queued": 1, "leased": 1, "succeeded": 1, "failed": 0, "cancelled": 1}
    [w] = doc["workers"]
    assert set(w) == WORKER_KEYS
    assert w == {
        "worker_id": "w1",
        "pool": "build",
        "labels": ["linux"],
        "capabilities": ["apiary.effects", "apiary.hooks", "apiary.workflow", "docker", "runner:shell"],
        "capacity": 2,
        "active_jobs": 1,
        "health": "healthy",
        "draining": False,
        "ready": True,
        "last_heartbeat_at": "2026-01-01T00:00:00Z",
    }
    [a] = doc["active"]
    assert set(a) == ACTIVE_KEYS
    instance = WorkflowInstance.objects.get(job=running)  # the payload names the instance and task of the job
    assert (instance_id(running), task_id(running)) == (instance.pk, instance.task_id)
    assert a == {
        "job_id": running.pk,
        "instance_id": instance.pk,
        "task_id": instance.task_id,
        "workflow": "triage",
        "parent_instance_id": None,  # not a spawned task's
        "hook": None,  # the instance's workflow job, not a hook job
        "worker_id": "w1",
        "attempt_number": 1,
        "lease_expires_at": "2026-01-01T00:00:30Z",
        "cancel_requested": True,
    }
    assert live.job_id == running.pk
    assert doc["blocked"] == [{"job_id": waiting.pk, "reason": "no worker in pool gpu"}]
    for value in (w["last_heartbeat_at"], a["lease_expires_at"]):
        assert RFC3339_UTC.match(value), value


def test_rfc3339_is_utc_with_z():
    tz = dt.timezone(dt.timedelta(hours=2))
    assert rfc3339(dt.datetime(2026, 1, 1, 2, 0, tzinfo=tz)) == "2026-01-01T00:00:00Z"
    assert rfc3339(dt.datetime(2026, 1, 1, 0, 0, 0, 500000, tzinfo=dt.UTC)) == "2026-01-01T00:00:00.500000Z"
    assert rfc3339(None) is None


def test_claimable_job_is_not_blocked(clock):
    register("w1")
    job = enqueue()
    assert job.pk not in reasons()
    assert status_document()["blocked"] == []


# --------------------------------------------------------------------------- health


def test_health_flips_to_stale_after_worker_timeout(clock, queue_config):
    queue_config(worker_timeout=30)
    register("w1")
    clock.advance(30)
    assert status_document()["workers"][0]["health"] == "healthy"  # exactly the timeout: not yet
    clock.advance(1)
    worker = Worker.objects.get(pk="w1")
    assert worker_health(worker, now=clock.now()) == "stale"
    assert not worker_can_claim(worker, now=clock.now())
    assert status_document()["workers"][0]["health"] == "stale"
    services.worker_heartbeat(worker_id="w1", session=worker.session)
    assert status_document()["workers"][0]["health"] == "healthy"


def test_active_jobs_counts_only_live_attempts(clock, queue_config):
    queue_config(lease_duration=10, worker_timeout=1000)
    worker = register("w1", capacity=3)
    enqueue(), enqueue()
    claim(worker, max_jobs=2)
    assert active_jobs(now=clock.now()) == {"w1": 2}
    clock.advance(11)  # leases passed, not yet reaped: no longer live
    assert active_jobs(now=clock.now()) == {}
    assert status_document()["workers"][0]["active_jobs"] == 0


# --------------------------------------------------------------------------- blocked reasons, one scenario each


def test_no_worker_registered(clock):
    job = enqueue()
    assert reasons() == {job.pk: "no worker registered"}


def test_no_worker_in_pool(clock):
    register("w1")
    job = enqueue(pool="build")
    assert reasons() == {job.pk: "no worker in pool build"}


def test_missing_label(clock):
    register("w1", pool="build", labels=["macos"])
    job = enqueue(pool="build", labels=["linux"])
    assert reasons() == {job.pk: "missing label linux"}


def test_missing_label_says_where_when_it_exists_outside_the_pool(clock):
    register("w1", pool="build")
    register("w2", pool="other", labels=["linux"])
    job = enqueue(pool="build", labels=["linux"])
    assert reasons() == {job.pk: "missing label linux in pool build"}


def test_missing_capability(clock):
    register("w1")
    job = enqueue(capabilities=["docker"])
    assert reasons() == {job.pk: "missing capability docker"}


def test_runner_not_available_anywhere(clock):
    register("w1", runners=("shell",))
    register("w2", runners=("claude-code",))
    job = enqueue(runner="codex-cli")
    assert reasons() == {job.pk: "runner codex-cli not available on any worker"}


def test_runner_not_available_in_pool(clock):
    register("w1", pool="build", runners=("shell",))
    register("w2", runners=("codex-cli",))
    job = enqueue(runner="codex-cli", pool="build")
    assert reasons() == {job.pk: "runner codex-cli not available on any worker in pool build"}


def _pin_task_to(worker) -> tuple:
    """Pin a fresh task to `worker` by claiming and finishing an affinity job of it."""
    task = make_task()
    first = enqueue(task, workflow="plan", affinity=True)
    [c] = claim(worker)
    assert c.job_id == first.pk
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    return task, enqueue(task, workflow="build", affinity=True)


def test_pinned_to_stale_worker(clock, queue_config):
    queue_config(worker_timeout=30)
    w1 = register("w1")
    task, job = _pin_task_to(w1)
    w2 = register("w2")
    clock.advance(31)
    services.worker_heartbeat(worker_id="w2", session=w2.session)  # w2 healthy and idle, but not w1
    other = enqueue()  # an unpinned job w2 can take is not blocked
    assert reasons() == {job.pk: "pinned to worker w1 (stale)"}
    assert other.pk not in reasons()
    services.affinity_release(key=affinity_key(task.pk))
    assert reasons() == {}


def test_pinned_to_busy_worker(clock):
    w1 = register("w1", capacity=1)
    register("w2")
    _, job = _pin_task_to(w1)
    busy = enqueue(priority=10)  # claimed first: w1 is then full
    [c] = claim(w1)
    assert c.job_id == busy.pk
    assert reasons() == {job.pk: "pinned to worker w1 (at capacity)"}


def test_pinned_to_draining_worker_only_blocks_affinity_jobs(clock):
    w1 = register("w1")
    register("w2")
    task, job = _pin_task_to(w1)
    unpinned = enqueue(task, workflow="lint")  # affinity off: w2 may take it
    services.worker_drain(worker_id="w1")
    assert reasons() == {job.pk: "pinned to worker w1 (draining)"}
    assert unpinned.pk not in reasons()


def test_limit_reached(clock, queue_config):
    queue_config(limits=Limits(overrides={"agent": {"deployer": 1}}))
    worker = register("w1", capacity=4)
    first = enqueue(agent="deployer")
    second = enqueue(agent="deployer")
    free = enqueue(agent="engineer")
    claimed = claim(worker, max_jobs=4)
    assert {c.job_id for c in claimed} == {first.pk, free.pk}
    assert reasons() == {second.pk: "agent limit deployer: 1 of 1 running"}


def test_default_limit_is_named_by_key(clock, queue_config):
    queue_config(limits=Limits(defaults={"project": 1}))
    worker = register("w1", capacity=4)
    enqueue(project="alpha")
    waiting = enqueue(project="alpha")
    claim(worker, max_jobs=4)
    assert reasons() == {waiting.pk: "project limit alpha: 1 of 1 running"}


@pytest.mark.parametrize(
    ("dimension", "key", "job"),
    [
        ("project", "hello", {"project": "hello"}),
        ("source", "inbox", {"source": "inbox"}),
        ("agent", "deployer", {"agent": "deployer"}),
        ("runner", "shell", {"runner": "shell"}),
        ("pool", "build", {"pool": "build"}),
    ],
)
def test_a_limit_holding_jobs_back_from_idle_workers_is_named_with_its_number(clock, queue_config, dimension, key, job):
    queue_config(limits=Limits(overrides={dimension: {key: 2}}))
    workers = [register(f"w{i}", pool="build", capacity=4) for i in range(3)]
    jobs = [enqueue(**job) for _ in range(5)]
    assert sum(len(claim(w, max_jobs=4)) for w in workers) == 2
    waiting = [j.pk for j in jobs if Job.objects.get(pk=j.pk).state == JobState.QUEUED]
    assert reasons() == dict.fromkeys(waiting, f"{dimension} limit {key}: 2 of 2 running")


def test_no_healthy_worker(clock, queue_config):
    queue_config(worker_timeout=30)
    register("w1")
    clock.advance(31)
    job = enqueue()
    assert reasons() == {job.pk: "no healthy worker (stale: w1)"}


def test_all_eligible_workers_draining(clock):
    register("w1")
    register("w2", pool="elsewhere")
    job = enqueue(pool="elsewhere")
    services.worker_drain(worker_id="w2")
    assert reasons() == {job.pk: "all eligible workers are draining"}


def test_worker_that_says_it_is_draining_counts_as_draining(clock):
    w = register("w1")
    services.worker_heartbeat(worker_id="w1", session=w.session, draining=True)
    job = enqueue()
    assert reasons() == {job.pk: "all eligible workers are draining"}


def test_no_eligible_worker_ready(clock):
    w = register("w1")
    services.worker_heartbeat(worker_id="w1", session=w.session, ready=False)
    job = enqueue()
    assert reasons() == {job.pk: "no eligible worker is ready"}


def test_all_eligible_workers_at_capacity(clock):
    worker = register("w1", capacity=1)
    enqueue()
    waiting = enqueue()
    claim(worker)
    assert reasons() == {waiting.pk: "all eligible workers are at capacity"}


def test_not_before(clock):
    worker = register("w1")
    job = enqueue(retry=Retry(max_attempts=3, backoff=60, backoff_max=60))
    [c] = claim(worker)
    assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed") == JobState.QUEUED
    job.refresh_from_db()
    assert job.available_at > clock.now()
    assert reasons() == {job.pk: f"not before {rfc3339(job.available_at)}"}
    clock.advance(61)
    services.worker_heartbeat(worker_id="w1", session=worker.session)
    assert reasons() == {}


# --------------------------------------------------------------------------- cost on a big queue


def _count_queries(fn) -> int:
    with CaptureQueriesContext(connection) as ctx:
        fn()
    return len(ctx.captured_queries)


def test_blocked_cost_does_not_grow_with_the_queue_and_is_capped(clock):
    register("w1")
    enqueue(pool="gpu")
    enqueue(labels=["arm"])
    small = _count_queries(status_document)
    for _ in range(40):
        enqueue(pool="gpu")
        enqueue(labels=["arm"])
    assert len(status_document()["blocked"]) == 82
    assert _count_queries(status_document) == small  # grouped: one verdict per group, not per job
    for _ in range(BLOCKED_LIMIT):
        enqueue(pool="gpu")
    assert _count_queries(status_document) <= small
    blocked = status_document()["blocked"]
    assert len(blocked) == BLOCKED_LIMIT
    assert len(blocked_reasons(limit=7)) == 7
    assert Job.objects.filter(state=JobState.QUEUED).count() == BLOCKED_LIMIT + 82
