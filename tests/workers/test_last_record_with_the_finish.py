"""The success of a job's last step, recorded by the embedded worker, commits with the job's
finish (or before it) instead of in a wait of its own (Journal.record_before_finish): never
later than the finish, and again ahead of a finish that is retried. A journal whose finish
does not follow (the executor called directly) records it before it returns, as any record.

The committer runs on its own thread with its own connection, as the embedded worker's
does, so the tests run on a transactional database."""

import threading

import pytest

from jobqueue import services
from jobqueue.groupcommit import GroupCommitter
from tests.factories import claim, enqueue, register
from workers.journal import Journal
from workers.transport import InProcessTransport

pytestmark = pytest.mark.django_db(transaction=True)

VALUE = {"output": "done", "worker_id": "w1"}


@pytest.fixture
def transport():
    # A deferred call commits with the next waited one or after defer_seconds: a minute here,
    # so only the waited call can have committed it.
    return InProcessTransport(worker_id="w1", committer=GroupCommitter(defer_seconds=60))


def journal_of(job_id: int) -> dict:
    return {key: (r.state, r.value) for key, r in services.records_of_job(job_id).items()}


def a_claim():
    job = enqueue()
    [c] = claim(register("w1"))
    return job, c


def test_the_last_steps_record_waits_for_the_finish_and_commits_with_it(transport):
    job, c = a_claim()
    journal = Journal(transport=transport, claim=c, cancel=threading.Event(), finish_follows=True)
    journal.record_before_finish("step:last", "done", VALUE)
    assert journal_of(job.pk) == {}  # queued, not committed: nobody waited for it
    assert transport.finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded", summary={}, error=None) == "succeeded"
    assert journal_of(job.pk) == {"step:last": ("done", VALUE)}


def test_without_a_finish_to_follow_the_record_is_committed_before_it_returns(transport):
    job, c = a_claim()
    journal = Journal(transport=transport, claim=c, cancel=threading.Event())
    journal.record_before_finish("step:last", "done", VALUE)
    assert journal_of(job.pk) == {"step:last": ("done", VALUE)}


class _Later:
    """A transport that only queues records for later: what the journal asks of it."""

    def __init__(self):
        self.queued: list[dict] = []

    def record_later(self, **call):
        self.queued.append(call)


def test_a_retried_finish_queues_the_last_record_again():
    _, c = a_claim()
    transport = _Later()
    journal = Journal(transport=transport, claim=c, cancel=threading.Event(), finish_follows=True)
    journal.resend_before_finish()
    assert transport.queued == []  # nothing queued before the finish: nothing to send again
    journal.record_before_finish("step:last", "done", VALUE)
    journal.resend_before_finish()  # the runtime, before it sends a failed finish again
    call = {"attempt_id": c.attempt_id, "token": c.token, "key": "step:last", "state": "done", "value": VALUE}
    assert transport.queued == [call, call]
