"""Bugs found once, pinned so they stay fixed."""

import json

import pytest

from jobqueue import services
from jobqueue.conf import Limits
from jobqueue.models import Job, JobState, RequirementSet
from jobqueue.services.attempts import _backoff
from jobqueue.types import Retry
from tests.factories import claim, enqueue, register
from workflows.runners import printable

pytestmark = pytest.mark.django_db


def test_a_full_pool_limit_does_not_hide_jobs_without_a_pool(clock, queue_config):
    # Found by the stateful test on PostgreSQL: the claim excluded saturated keys
    # with `pool NOT IN (…)`, which is never true for a job whose pool is NULL.
    queue_config(limits=Limits(overrides={"pool": {"build": 1}}))
    builds = [enqueue(pool="build") for _ in range(3)]
    anywhere = enqueue()
    worker = register("w1", pool="build", capacity=4)
    claimed = {c.job_id for c in claim(worker, max_jobs=3)}
    assert claimed == {builds[0].pk, anywhere.pk}


SUMMARY_WITH_NUL = {"steps": [{"id": "s", "status": "succeeded", "output_tail": "a\x00b"}]}


@pytest.mark.parametrize(
    ("summary", "error"),
    [(SUMMARY_WITH_NUL, None), ({}, "x\x00y"), ({"file": "name-\udcff"}, None)],
    ids=["nul-in-summary", "nul-in-error", "lone-surrogate"],
)
def test_a_finish_carrying_text_no_database_stores_still_lands(clock, summary, error):
    # Found in review: PostgreSQL refuses NUL in text and jsonb, and no store
    # takes a lone surrogate; such a finish raised DataError and the job, done,
    # expired and ran again. Unstorable characters now become U+FFFD.
    job = enqueue()
    [c] = claim(register("w1"))
    state = services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded", summary=summary, error=error)
    assert state == JobState.SUCCEEDED
    job.refresh_from_db()
    assert "\x00" not in json.dumps(job.summary) and "\x00" not in job.reason


def test_step_output_with_nul_is_storable_at_the_source():
    assert printable(b"a\x00b\xff") == "a\ufffdb\ufffd"


def test_more_job_classes_than_one_sqlite_compound_select_takes(clock):
    # SQLite allows 500 terms in a compound SELECT; the claim walks one per class.
    for i in range(501):
        enqueue(agent=f"agent-{i}", priority=i)
    assert RequirementSet.objects.count() == 501
    [c] = claim(register("w1"))
    assert Job.objects.get(pk=c.job_id).agent == "agent-500"  # the best of all 501 classes


def test_max_attempts_counts_expiries_not_failed_finishes(clock, queue_config):
    queue_config(lease_duration=30)
    job = enqueue(max_attempts=2, retry=Retry(max_attempts=10))
    worker = register("w1")
    [c] = claim(worker)
    assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed") == JobState.QUEUED
    claim(worker)
    clock.advance(31)
    services.leases_expire()
    job.refresh_from_db()
    assert job.state == JobState.QUEUED  # one expiry of two allowed
    claim(worker)
    clock.advance(31)
    services.leases_expire()
    job.refresh_from_db()
    assert job.state == JobState.FAILED and "lease expired 2 times" in job.reason


def test_backoff_of_a_long_failing_job_stays_at_its_cap():
    assert 150 <= _backoff(1.0, 300.0, 1100) <= 300
