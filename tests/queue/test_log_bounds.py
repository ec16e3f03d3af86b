"""What one attempt's (or a hostile worker's) log stream can make the control plane
store is bounded: an attempt's streams together, the attempts a job keeps logs of,
how long a finished job's logs stay, and how much one append rewrites."""


import pytest

from jobqueue import services
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import LogChunk, LogStream
from jobqueue.services import logs
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def held(worker_id="w1"):
    enqueue()
    [c] = claim(register(worker_id))
    return c


def append(c, text, *, stream="plan", offset=0, final=False):
    return services.log_append(attempt_id=c.attempt_id, token=c.token, stream=stream, offset=offset, text=text, final=final)


def test_an_attempts_streams_together_keep_a_bounded_total(clock, monkeypatch):
    monkeypatch.setattr(logs, "MAX_LOG_BYTES_PER_ATTEMPT", 10)
    c = held()
    append(c, "12345", stream="a")
    append(c, "12345", stream="b")
    with pytest.raises(InvalidRequest, match="at most 10 bytes of logs"):
        append(c, "x", stream="c")
    assert sum(s.received for s in LogStream.objects.all()) == 10


def test_a_job_keeps_the_logs_of_its_last_two_attempts(clock, queue_config):
    queue_config(lease_duration=5, max_attempts=5)
    worker = register("w1")
    enqueue()
    for number in (1, 2, 3):
        [c] = claim(worker)
        append(c, f"attempt {number}\n")
        clock.advance(6)
        services.leases_expire()
    kept = sorted(LogStream.objects.values_list("attempt__number", flat=True))
    assert kept == [2, 3]


def test_a_finished_jobs_logs_are_pruned_after_the_retention(clock):
    c = held()
    append(c, "done\n", final=True)
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    assert services.logs_prune(older_than=3600) == 0  # not old enough
    clock.advance(3601)
    assert services.logs_prune(older_than=3600) == 1
    assert not LogStream.objects.exists() and not LogChunk.objects.exists()


def test_small_sends_extend_a_row_only_while_it_is_small(clock, monkeypatch):
    """Each extension rewrites the row: past MERGE_BELOW a send starts a new row instead."""
    monkeypatch.setattr(logs, "MERGE_BELOW", 8)
    c = held()
    offset = 0
    for _ in range(6):
        offset = append(c, "abcd", offset=offset).received
    assert sorted(LogChunk.objects.values_list("size", flat=True)) == [8, 8, 8]
