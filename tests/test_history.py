"""The embedded worker's step history (workflows/history.py): one statement per step event, and
rows that say what the ORM wrote before — what `apiary status` and the admin show."""

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobqueue import sql
from jobqueue.types import Claim
from tests.factories import enqueue, instance_id
from workflows import history
from workflows.history import DatabaseHistory
from workflows.models import StepRun
from workflows.runners import StepResult

pytestmark = pytest.mark.django_db

STARTED = dt.datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=dt.UTC)


def claim_of(job, attempt: int = 1) -> Claim:
    return Claim(job_id=job.pk, attempt_id=1, attempt_number=attempt, token="t", lease_expires_at=STARTED,
                 agent="engineer", runner="shell", payload=job.payload)  # fmt: skip


def result(status: str, exit_code: int | None, tail: str) -> StepResult:
    ended = STARTED + dt.timedelta(seconds=2)
    return StepResult(status=status, exit_code=exit_code, started_at=STARTED, ended_at=ended, duration=2.0,
                      log_path="/x.log", output="", output_tail=tail)  # fmt: skip


def test_a_step_is_one_insert_when_it_starts_and_one_update_when_it_ends():
    job = enqueue()
    claim, history = claim_of(job), DatabaseHistory()
    with CaptureQueriesContext(connection) as started:
        history.step_started(claim=claim, worker_id="embedded", step_id="plan", started_at=STARTED, log_path="/l/plan.log")
    row = StepRun.objects.get(instance_id=job.payload["instance_id"])
    assert (row.attempt_number, row.step_id, row.status, row.worker_id, row.started_at, row.log_path) == (
        1, "plan", "running", "embedded", STARTED, "/l/plan.log"
    )
    assert (row.ended_at, row.exit_code, row.output_tail) == (None, None, "")
    with CaptureQueriesContext(connection) as finished:
        history.step_finished(claim=claim, worker_id="embedded", step_id="plan", result=result("failed", 3, "boom\x1b"))
    row.refresh_from_db()
    assert (row.status, row.ended_at, row.exit_code, row.output_tail) == (
        "failed", STARTED + dt.timedelta(seconds=2), 3, "boom\x1b"
    )
    assert len(started) == 1 and len(finished) == 1  # no transaction of its own around either


def test_a_step_started_again_in_the_same_attempt_updates_its_row_and_keeps_the_others():
    job = enqueue()
    history = DatabaseHistory()
    for attempt in (1, 2):
        history.step_started(claim=claim_of(job, attempt), worker_id="w1", step_id="plan", started_at=STARTED, log_path="")
    later = STARTED + dt.timedelta(minutes=1)
    history.step_started(claim=claim_of(job, 2), worker_id="w2", step_id="plan", started_at=later, log_path="/again.log")
    rows = {r.attempt_number: r for r in StepRun.objects.filter(instance_id=job.payload["instance_id"])}
    assert (rows[1].worker_id, rows[1].started_at) == ("w1", STARTED)
    assert (rows[2].worker_id, rows[2].started_at, rows[2].log_path, rows[2].status) == ("w2", later, "/again.log", "running")


# Group commit (the embedded worker defers each write into its next commit): a batch's writes in few statements.

_KEYS = [(1, "plan"), (1, "build"), (2, "plan")]  # (attempt number, step id); each test job has one instance
_writes = st.lists(
    st.tuples(st.sampled_from(["started", "finished"]), st.sampled_from(range(len(_KEYS))), st.integers(0, 9)),
    max_size=8,
)


def _call(instance: int, kind: str, key: int, n: int) -> dict:
    number, step = _KEYS[key]
    at = sql.ts(STARTED + dt.timedelta(seconds=n))
    if kind == "started":
        return {"statement": history._STARTED, "params": (instance, number, step, f"w{n}", at, f"/l/{n}.log")}
    return {"statement": history._FINISHED, "params": (["failed", "succeeded"][n % 2], at, n, f"tail {n}", instance, number, step)}


def _rows(instance: int) -> list[tuple]:
    return list(
        StepRun.objects.filter(instance_id=instance)
        .order_by("attempt_number", "step_id")
        .values_list("attempt_number", "step_id", "status", "worker_id", "started_at", "log_path", "ended_at", "exit_code", "output_tail")
    )


@pytest.fixture
def two_instances():
    # Function-scoped: Hypothesis runs every example inside the one test, in its transaction.
    return [instance_id(enqueue()), instance_id(enqueue())]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=_writes, batch=_writes)
def test_a_batch_of_history_writes_leaves_what_they_leave_one_by_one(two_instances, before, batch):
    one_by_one, together = two_instances
    StepRun.objects.filter(instance_id__in=two_instances).delete()  # an example before (a failed one too) left rows
    for instance, calls in ((one_by_one, before), (together, before)):  # the same rows there before the batch
        for kind, key, n in calls:
            history._write(**_call(instance, kind, key, n))
    for kind, key, n in batch:
        history._write(**_call(one_by_one, kind, key, n))
    answers = history._write_many([_call(together, kind, key, n) for kind, key, n in batch])
    assert answers == [(None, None)] * len(batch)
    assert _rows(together) == _rows(one_by_one)


def test_a_batch_writes_a_step_started_and_finished_in_it_as_one_row_and_the_other_starts_in_one_statement():
    job, other = enqueue(), enqueue()
    a, b = instance_id(job), instance_id(other)
    batch = [_call(a, "started", 0, 1), _call(b, "started", 0, 2), _call(b, "started", 1, 3), _call(a, "finished", 0, 4)]
    with CaptureQueriesContext(connection) as queries:
        history._write_many(batch)
    assert len(queries) == 2  # the whole row of a's step; b's two starts
    assert [(r[1], r[2], r[7]) for r in _rows(a)] == [("plan", "failed", 4)]
    assert [(r[1], r[2]) for r in _rows(b)] == [("build", "running"), ("plan", "running")]
    # A finish whose start was committed before is its own update.
    with CaptureQueriesContext(connection) as queries:
        history._write_many([_call(b, "finished", 0, 5), _call(b, "finished", 1, 6)])
    assert len(queries) == 2
    assert [(r[1], r[2], r[7]) for r in _rows(b)] == [("build", "failed", 6), ("plan", "succeeded", 5)]
