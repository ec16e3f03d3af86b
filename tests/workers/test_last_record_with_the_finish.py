"""The success of a job's last step, recorded by the embedded worker, is carried by the job's
finish (Journal.record_before_finish, services.attempt_finish_and_claim's `record`): written
under the finish's fence in the finish's transaction, never without it, and by every try of
a finish that is retried. A journal whose finish carries nothing (the executor called
directly, a remote worker) records it before it returns, as any record.

The committer runs on its own thread with its own connection, as the embedded worker's
does, so the tests run on a transactional database."""

import threading

import pytest

from jobqueue import selectors, services
from jobqueue.exceptions import StaleAttempt
from jobqueue.groupcommit import GroupCommitter
from tests.factories import claim, enqueue, register
from workers.journal import Journal
from workers.transport import InProcessTransport

pytestmark = pytest.mark.django_db(transaction=True)

VALUE = {"output": "done", "worker_id": "w1"}


@pytest.fixture
def transport():
    return InProcessTransport(worker_id="w1", committer=GroupCommitter())


def journal_of(job_id: int) -> dict:
    return {key: (r.state, r.value) for key, r in services.records_of_job(job_id).items()}


def a_claim():
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    return job, c, worker


def finish(transport, c, worker, **carried):
    return transport.finish_and_claim(
        attempt_id=c.attempt_id, token=c.token, outcome="succeeded", summary={}, error=None,
        session=worker.session, max_jobs=0, **carried,
    )  # fmt: skip


def test_the_last_steps_record_is_kept_for_the_finish_and_commits_with_it(transport):
    job, c, worker = a_claim()
    journal = Journal(transport=transport, claim=c, cancel=threading.Event(), finish_carries=True)
    journal.record_before_finish("step:last", "done", VALUE)
    assert journal_of(job.pk) == {}  # kept for the finish: nothing sent
    assert finish(transport, c, worker, record=journal.before_finish) == ("succeeded", [], ())
    assert journal_of(job.pk) == {"step:last": ("done", VALUE)}


def test_without_a_finish_to_carry_it_the_record_is_committed_before_it_returns(transport):
    job, c, _ = a_claim()
    journal = Journal(transport=transport, claim=c, cancel=threading.Event())
    journal.record_before_finish("step:last", "done", VALUE)
    assert journal.before_finish is None
    assert journal_of(job.pk) == {"step:last": ("done", VALUE)}


def test_a_stale_finish_writes_nothing_it_carries(transport):
    job, c, worker = a_claim()
    with pytest.raises(StaleAttempt):
        transport.finish_and_claim(
            attempt_id=c.attempt_id, token="not-the-token", outcome="succeeded", summary={}, error=None,
            session=worker.session, max_jobs=0, record={"key": "step:last", "state": "done", "value": VALUE},
            log_ends=[{"stream": "last", "offset": 0, "text": "bye\n"}],
        )  # fmt: skip
    assert journal_of(job.pk) == {}
    assert selectors.log_streams(job_id=job.pk) == []


def test_a_refused_record_is_named_and_the_finish_stands(transport, monkeypatch):
    monkeypatch.setattr("jobqueue.services.records.MAX_RECORDS_PER_JOB", 1)
    job, c, worker = a_claim()
    services.job_record(attempt_id=c.attempt_id, token=c.token, key="first", state="done", value={})  # the journal is full
    state, _, refused = finish(transport, c, worker, record={"key": "step:last", "state": "done", "value": VALUE})
    assert state == "succeeded"
    assert len(refused) == 1 and "step:last" in refused[0] and "journal holds at most" in refused[0]
    assert "step:last" not in journal_of(job.pk)
