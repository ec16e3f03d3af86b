"""The embedded worker's step history (workflows/history.py): one statement per step event, and
rows that say what the ORM wrote before — what `apiary status` and the admin show."""

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobqueue.types import Claim
from tests.factories import enqueue
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
