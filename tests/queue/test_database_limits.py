"""The queue works within what every database it runs on accepts: text no
store takes is made storable, and no statement is larger than SQLite allows.
"""

import json

import pytest

from jobqueue import services
from jobqueue.models import Job, JobState, RequirementSet
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


SUMMARY_WITH_NUL = {"steps": [{"id": "s", "status": "succeeded", "output_tail": "a\x00b"}]}


@pytest.mark.parametrize(
    ("summary", "error"),
    [(SUMMARY_WITH_NUL, None), ({}, "x\x00y"), ({"file": "name-\udcff"}, None)],
    ids=["nul-in-summary", "nul-in-error", "lone-surrogate"],
)
def test_a_finish_carrying_text_no_database_stores_still_lands(clock, summary, error):
    # PostgreSQL refuses NUL in text and jsonb, and no store
    # takes a lone surrogate; such a finish raised DataError and the job, done,
    # expired and ran again. Unstorable characters now become U+FFFD.
    job = enqueue()
    [c] = claim(register("w1"))
    state = services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded", summary=summary, error=error)
    assert state == JobState.SUCCEEDED
    job.refresh_from_db()
    assert "\x00" not in json.dumps(job.summary) and "\x00" not in job.reason


def test_more_job_classes_than_one_sqlite_compound_select_takes(clock):
    # SQLite allows 500 terms in a compound SELECT; the claim walks one per class.
    for i in range(501):
        enqueue(agent=f"agent-{i}", priority=i)
    assert RequirementSet.objects.count() == 501
    [c] = claim(register("w1"))
    assert Job.objects.get(pk=c.job_id).agent == "agent-500"  # the best of all 501 classes
