"""The hot path's query counts, pinned so an N+1 cannot creep in.

Counts are taken inside pytest-django's `db` transaction, so each service's
durable transaction shows up as a SAVEPOINT / RELEASE pair on both backends
(the two "+ 2" below).
"""

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobqueue import services
from jobqueue.conf import Limits
from jobqueue.models import Affinity, Job, JobEvent, JobState, RequirementSet, Worker
from jobqueue.types import Retry
from tests.factories import claim, enqueue, make_task, register
from workflows.models import Task

pytestmark = pytest.mark.django_db

TX = 2  # SAVEPOINT + RELEASE SAVEPOINT of the service's own transaction


def claim_tx() -> int:
    """A claim's fixed cost: PostgreSQL first locks the worker's row, then counts its attempts."""
    return TX + (1 if connection.vendor == "postgresql" else 0)


def walk() -> int:
    """Finding a claim's candidates: the per-class walk, and on PostgreSQL then locking their rows
    (SQLite, one writer at a time, takes the walk's rows as they are)."""
    return 2 if connection.vendor == "postgresql" else 1


def moves() -> int:
    """What leasing a claim's jobs (attempts, jobs, events) or settling one job (attempt, job, event)
    costs: one statement on PostgreSQL (data-modifying CTEs), three on SQLite."""
    return 1 if connection.vendor == "postgresql" else 3


def no_gaps() -> None:
    """PostgreSQL: the ids other tests' rolled-back sets took are gaps the claim reads again
    (an id below the newest may belong to a set still committing); here, none may."""
    services.requirement_cache.gaps.clear()


def test_enqueue_of_one_job(clock, django_assert_num_queries):
    kw = {"payload": {}, "project": "p", "source": "s", "agent": "a", "runner": "shell"}
    services.job_enqueue(key="first", **kw)  # its class exists from here on
    # the job (its class found by digest in the same insert), its event (PostgreSQL: by the same statement), the wake
    with django_assert_num_queries(TX + (2 if connection.vendor == "postgresql" else 3)):
        assert services.job_enqueue(key="second", **kw)[1] is True
    with django_assert_num_queries(TX + 2):  # a key already queued: the insert that did nothing, the read
        assert services.job_enqueue(key="second", **kw)[1] is False


def test_claim_of_one_job(clock, django_assert_num_queries):
    job = enqueue()
    worker = register("w1")
    # worker + capacity, requirement sets, candidates; attempt, job, event
    with django_assert_num_queries(claim_tx() + 2 + walk() + moves()):
        [c] = claim(worker)
    assert c.job_id == job.pk


def test_claim_of_several_jobs_leases_them_all_in_one_go(clock, django_assert_num_queries):
    for _ in range(4):
        enqueue()
    worker = register("w1", capacity=4)
    with django_assert_num_queries(claim_tx() + 2 + walk() + moves()):  # the leases' writes, whatever their number
        assert len(claim(worker, 4)) == 4


def test_claim_with_no_requirement_set_it_satisfies_skips_the_job_query(clock, django_assert_num_queries):
    enqueue(labels=["gpu"])
    worker = register("w1")
    with django_assert_num_queries(claim_tx() + 2):
        assert claim(worker) == []


def test_claim_that_finds_no_queued_job(clock, django_assert_num_queries):
    enqueue()
    claim(register("other"))
    worker = register("w1")
    no_gaps()
    with django_assert_num_queries(claim_tx() + 2):  # worker (its classes all known), the walk that finds none
        assert claim(worker) == []


def test_a_claim_reads_job_classes_only_when_one_is_new_to_its_process(clock, django_assert_num_queries):
    enqueue()
    worker = register("w1", capacity=3)
    claim(worker)  # its class is known to this process from here on
    no_gaps()
    enqueue()
    with django_assert_num_queries(claim_tx() + 1 + walk() + moves()):  # worker and the newest class id, candidates
        assert len(claim(worker)) == 1
    job = enqueue(project="other")  # a class of its own, which the claim must read to find its job
    with django_assert_num_queries(claim_tx() + 2 + walk() + moves()):
        [c] = claim(worker)
    assert c.job_id == job.pk


def test_claim_of_idle_worker_at_capacity_stops_early(clock, django_assert_num_queries):
    enqueue(), enqueue()
    worker = register("w1")
    claim(worker)
    with django_assert_num_queries(claim_tx() + 1):  # its own row says it is full
        assert claim(worker) == []


def test_claim_with_limits_counts_live_attempts_in_one_query(clock, queue_config, django_assert_num_queries):
    queue_config(limits=Limits(defaults={"project": 5, "agent": 5}))
    enqueue(), enqueue()
    worker = register("w1", capacity=2)
    # PostgreSQL also takes an advisory lock per limited job and recounts under it.
    per_job = 2 if connection.vendor == "postgresql" else 0
    with django_assert_num_queries(claim_tx() + 3 + walk() + per_job * 2 + moves()):
        assert len(claim(worker, 2)) == 2


def test_heartbeat(clock, django_assert_num_queries):
    enqueue()
    [c] = claim(register("w1"))
    with django_assert_num_queries(TX + 2):  # fenced read, lease update
        assert services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token).cancel is False


def test_finish(clock, django_assert_num_queries):
    enqueue()
    [c] = claim(register("w1"))
    # fenced read; attempt, job; event — queue tables only (the instance and task read the job)
    with django_assert_num_queries(TX + 1 + moves()):
        assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded") == "succeeded"


@pytest.mark.parametrize(
    "outcome, retries", [("succeeded", 1), ("failed", 2), ("failed", 1), ("cancelled", 1)],
    ids=["succeeded", "failed-with-a-retry-left", "failed-for-good", "cancelled"],
)
def test_hot_path_touches_queue_tables_only(clock, outcome, retries):
    # The queue knows nothing above it: claim, heartbeat and finish read and
    # write queue tables only, whatever the outcome (a workflow instance and
    # its task read their state from the job).
    enqueue(affinity=True, retry=Retry(max_attempts=retries))
    worker = register("w1")
    with CaptureQueriesContext(connection) as seen:
        [c] = claim(worker)
        services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token)
        services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome=outcome)
    tables = set()
    for q in seen.captured_queries:
        named = set(re.findall(r"\b(\w+)(?: \([\w, ]+\))? AS \(", q["sql"]))  # a statement's own CTEs (PostgreSQL) are no tables
        tables |= set(re.findall(r'\b(?:FROM|JOIN|INTO|(?<!FOR )UPDATE)\s+"?(\w+)', q["sql"])) - named
    assert tables and all(name.startswith("queue_") for name in tables), sorted(tables)


def test_retried_finish_is_a_single_read(clock, django_assert_num_queries):
    enqueue()
    [c] = claim(register("w1"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    with django_assert_num_queries(TX + 1):
        assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded") == "succeeded"


# Queued jobs the worker cannot take, each kind ahead of the one it can take
# (higher priority), so a claim that walked them would have to pass them all.


def _blocked_by_label(n):
    for _ in range(n):
        enqueue(labels=["gpu"], priority=9)


def _blocked_by_capability(n):
    for _ in range(n):
        enqueue(runner="codex-cli", priority=9)


def _blocked_by_pool(n):
    for _ in range(n):
        enqueue(pool="deploy", priority=9)


def _blocked_by_pin(n):
    task = make_task()
    enqueue(task, workflow="first", affinity=True, priority=9)
    claim(register("pinner"))  # pins the task to another worker
    for i in range(n):
        enqueue(task, workflow=f"later-{i}", affinity=True, priority=9)


def _blocked_by_limit(n):
    enqueue(project="full", priority=9)
    claim(register("holder"))  # holds the only slot of project "full"
    for _ in range(n):
        enqueue(project="full", priority=9)


BLOCKERS = [_blocked_by_label, _blocked_by_capability, _blocked_by_pool, _blocked_by_pin, _blocked_by_limit]


def _claim_queries(blocker, n: int) -> int:
    """Queries of a claim that takes the one job it can, with `n` it cannot take ahead of it."""
    blocker(n)
    takeable = enqueue(project="free", priority=0)
    worker = register("w1")
    with CaptureQueriesContext(connection) as queries:
        [c] = claim(worker)
    assert c.job_id == takeable.pk
    return len(queries.captured_queries)


@pytest.mark.parametrize("blocker", BLOCKERS, ids=lambda b: b.__name__)
def test_claim_cost_does_not_grow_with_jobs_the_worker_cannot_take(clock, queue_config, blocker):
    queue_config(limits=Limits(overrides={"project": {"full": 1}}))
    with_one = _claim_queries(blocker, 1)
    # Start over with an empty queue: services refuse to nest in a savepoint
    # we could roll back, so the rows go through the ORM.
    _reset_queue()
    with_many = _claim_queries(blocker, 200)
    assert with_many == with_one


def _reset_queue():
    JobEvent.objects.all().delete()
    Job.objects.all().delete()  # cascades to attempts
    Affinity.objects.all().delete()
    RequirementSet.objects.all().delete()
    Worker.objects.all().delete()
    Task.objects.all().delete()
    services.requirement_cache.reset()


def test_blocked_jobs_stay_queued(clock, queue_config):
    # The counting test above is only meaningful if the blockers really block.
    queue_config(limits=Limits(overrides={"project": {"full": 1}}))
    for blocker in BLOCKERS:
        blocker(3)
    worker = register("w1", capacity=50)
    assert claim(worker, 50) == []
    assert Job.objects.filter(state=JobState.QUEUED).count() == 5 * 3
