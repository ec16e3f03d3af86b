"""A journal's new key and a quiet step's log end are each one insert, guarded in the same
statement by the rules a read before it used to check (records.py `_insert_new`, logs.py
`_BEGIN_ENDED`: the room left, and ON CONFLICT for a key or stream already there); where
the guard stops the insert, the full rules decide as before. A checkpoint, written again at
every heartbeat, is read first."""

import pytest

from jobqueue import services
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import JobRecord, LogStream
from jobqueue.services import logs as log_service
from jobqueue.services.logs import log_append
from jobqueue.services.records import job_record
from tests.factories import claim, enqueue, register
from tests.queue.test_query_counts import TX

pytestmark = pytest.mark.django_db


def held(worker_id="w1"):
    job = enqueue()
    worker = register(worker_id)
    [c] = claim(worker)
    return job, worker, c


def quiet_end(c, stream="work"):
    return log_append(attempt_id=c.attempt_id, token=c.token, stream=stream, offset=0, text="", final=True)


def streams(job) -> dict:
    return {
        (s.attempt.number, s.name): (s.received, s.ended)
        for s in LogStream.objects.filter(job=job).select_related("attempt")
    }


def test_a_new_key_is_the_fenced_read_and_one_insert(clock, django_assert_num_queries):
    job, _, c = held()
    with django_assert_num_queries(TX + 1 + 1):
        record = job_record(attempt_id=c.attempt_id, token=c.token, key="step:plan", state="started")
    assert (record.state, record.started_by, record.already_done) == ("started", 1, False)
    row = JobRecord.objects.get(job=job)
    assert (row.key, row.kind, row.state, row.started_by, row.attempt_number) == ("step:plan", "step", "started", 1, 1)


def test_a_key_already_there_is_decided_by_the_full_rules(clock, django_assert_num_queries):
    _, _, c = held()
    job_record(attempt_id=c.attempt_id, token=c.token, key="publish:pr", state="started")
    # the fenced read, the insert that inserts nothing, the key's row, its update, the row as updated
    with django_assert_num_queries(TX + 1 + 4):
        done = job_record(attempt_id=c.attempt_id, token=c.token, key="publish:pr", state="done", value={"output": "1"})
    assert (done.state, done.value, done.started_by, done.already_done) == ("done", {"output": "1"}, 1, False)
    again = job_record(attempt_id=c.attempt_id, token=c.token, key="publish:pr", state="done", value={"output": "2"})
    assert again.already_done and again.value == {"output": "1"}


def test_a_checkpoint_is_read_first_and_written_over_without_an_insert(clock, django_assert_num_queries):
    job, _, c = held()

    def keep(content):
        return services.attempt_heartbeat_with_checkpoint(attempt_id=c.attempt_id, token=c.token, step="s", content=content)

    with django_assert_num_queries(TX + 2 + 2):  # the heartbeat's read and lease; the key's row (none), the insert
        keep("one")
    with django_assert_num_queries(TX + 2 + 3):  # the heartbeat's; the key's row, its update, the row as updated
        keep("two")
    row = JobRecord.objects.get(job=job)
    assert (row.key, row.state, row.value) == ("checkpoint:s", "started", {"content": "two"})


def test_a_quiet_steps_end_is_the_fenced_read_and_one_insert(clock, django_assert_num_queries):
    job, _, c = held()
    with django_assert_num_queries(TX + 1 + 1):
        state = quiet_end(c)
    assert (state.received, state.dropped, state.ended, state.stored) == (0, 0, True, False)
    assert streams(job) == {(1, "work"): (0, True)}


def test_a_quiet_end_of_a_stream_begun_empty_ends_it(clock):
    job, _, c = held()
    log_append(attempt_id=c.attempt_id, token=c.token, stream="work", offset=0, text="")
    assert streams(job) == {(1, "work"): (0, False)}
    assert quiet_end(c).ended
    assert streams(job) == {(1, "work"): (0, True)}


def test_a_quiet_end_of_a_stream_with_text_is_a_resend_within_it(clock):
    job, _, c = held()
    log_append(attempt_id=c.attempt_id, token=c.token, stream="work", offset=0, text="out\n")
    state = quiet_end(c)
    assert (state.received, state.ended, state.stored) == (4, False, False)
    assert streams(job) == {(1, "work"): (4, False)}


def test_a_quiet_end_past_the_attempts_most_streams_is_refused_and_writes_nothing(clock, monkeypatch):
    monkeypatch.setattr(log_service, "MAX_LOG_STREAMS_PER_ATTEMPT", 1)
    job, _, c = held()
    quiet_end(c, "first")
    with pytest.raises(InvalidRequest, match="at most 1 log streams"):
        quiet_end(c, "second")
    assert streams(job) == {(1, "first"): (0, True)}


def test_a_later_attempts_quiet_end_still_keeps_only_the_last_attempts_logs(clock, queue_config):
    """An attempt past LOG_ATTEMPTS_KEPT takes the full path: its first stream prunes the oldest."""
    queue_config(lease_duration=5)
    job, worker, first = held()
    log_append(attempt_id=first.attempt_id, token=first.token, stream="work", offset=0, text="one\n")
    clock.advance(6)
    services.leases_expire()
    [second] = claim(worker)
    log_append(attempt_id=second.attempt_id, token=second.token, stream="work", offset=0, text="two\n")
    clock.advance(6)
    services.leases_expire()
    [third] = claim(worker)
    quiet_end(third)
    assert streams(job) == {(2, "work"): (4, False), (3, "work"): (0, True)}
