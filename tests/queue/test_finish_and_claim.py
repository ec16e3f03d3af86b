"""attempt_finish_and_claim: a finish that claims the worker's next job in its own
transaction. The claim comes after the finish (the slot it freed counts), a finish
refused claims nothing, a claim refused leaves the finish standing, and many calls
in one group commit share one claim per worker."""

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from jobqueue import selectors, services
from jobqueue.exceptions import StaleAttempt
from jobqueue.models import Attempt, AttemptState, Job, JobState
from tests.factories import claim, enqueue, register
from tests.queue.test_query_counts import TX, claim_tx, moves, no_gaps, walk

pytestmark = pytest.mark.django_db


def _finish_and_claim(worker, c, **kwargs):
    kwargs = {"token": c.token, "outcome": "succeeded", "session": worker.session, **kwargs}
    return services.attempt_finish_and_claim(attempt_id=c.attempt_id, worker_id=worker.worker_id, **kwargs)


def test_the_finish_frees_its_slot_for_the_claim_in_the_same_transaction(clock):
    first, second = enqueue(), enqueue()
    worker = register("w1", capacity=1)
    [c] = claim(worker)
    assert claim(worker) == []  # at capacity: a claim before the finish gets nothing
    done = _finish_and_claim(worker, c)
    assert done.job_state == JobState.SUCCEEDED
    [following] = done.claims
    assert following.job_id == second.pk != first.pk
    assert Attempt.objects.get(pk=following.attempt_id).state == AttemptState.ACTIVE
    assert Job.objects.get(pk=first.pk).state == JobState.SUCCEEDED


def test_no_claim_when_none_is_asked_or_none_is_queued(clock):
    enqueue(), enqueue()
    worker = register("w1", capacity=2)
    c1, c2 = claim(worker, max_jobs=2)
    assert _finish_and_claim(worker, c1, max_jobs=0).claims == []
    assert _finish_and_claim(worker, c2).claims == []  # nothing left to claim
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 2


def test_a_refused_finish_claims_nothing(clock):
    enqueue()
    waiting = enqueue()
    worker = register("w1", capacity=2)
    [c] = claim(worker)
    with pytest.raises(StaleAttempt):
        _finish_and_claim(worker, c, token="not-the-token")
    assert Job.objects.get(pk=waiting.pk).state == JobState.QUEUED
    assert Attempt.objects.count() == 1


def test_a_refused_claim_leaves_the_finish_standing(clock):
    job = enqueue()
    waiting = enqueue()
    worker = register("w1", capacity=1)
    [c] = claim(worker)
    done = _finish_and_claim(worker, c, session="a-superseded-session")
    assert (done.job_state, done.claims) == (JobState.SUCCEEDED, [])
    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
    assert Job.objects.get(pk=waiting.pk).state == JobState.QUEUED


def test_many_calls_share_one_claim_per_worker_and_keep_their_own_answers(clock, monkeypatch):
    from jobqueue.services import chaining

    claims_made = []
    real = chaining._claim
    monkeypatch.setattr(chaining, "_claim", lambda *a: claims_made.append(a[2]) or real(*a))
    for _ in range(6):
        enqueue()
    worker = register("w1", capacity=3)
    c1, c2, c3 = claim(worker, max_jobs=3)
    call = {"outcome": "succeeded", "worker_id": worker.worker_id, "session": worker.session, "max_jobs": 1}
    calls = [
        {**call, "attempt_id": c1.attempt_id, "token": c1.token},
        {**call, "attempt_id": c2.attempt_id, "token": "not-the-token"},
        {**call, "attempt_id": c3.attempt_id, "token": c3.token},
    ]
    with transaction.atomic():
        answers = services.attempt_finish_and_claim.body.many(calls)
    (first, none1), (refused, error), (third, none3) = answers
    assert none1 is None and none3 is None and refused is None and isinstance(error, StaleAttempt)
    [n1], [n3] = first.claims, third.claims
    assert n1.job_id != n3.job_id and {n1.job_id, n3.job_id}.isdisjoint({c1.job_id, c2.job_id, c3.job_id})
    # The refused finish freed no slot: c2's attempt is still live, so two were claimed, not three.
    assert Job.objects.filter(state=JobState.QUEUED).count() == 1
    assert claims_made == [2]  # one claim for the two finished calls of the worker
    assert Attempt.objects.get(pk=c2.attempt_id).state == AttemptState.ACTIVE


def test_finish_and_claim_is_a_finish_then_a_claim_in_one_transaction(clock, django_assert_num_queries):
    enqueue(), enqueue()
    worker = register("w1", capacity=1)
    [c] = claim(worker)
    no_gaps()
    # the finish (fenced read; attempt, job, event), then the claim (worker, its classes known; candidates; leases)
    with django_assert_num_queries(TX + 1 + moves() + (claim_tx() - TX) + 1 + walk() + moves()):
        assert len(_finish_and_claim(worker, c).claims) == 1
    assert connection.in_atomic_block  # pytest-django's transaction: the service's own was a savepoint in it


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite gives a rolled-back id to the next row; PostgreSQL never")
def test_a_claim_that_fails_forgets_the_job_classes_its_transaction_made(clock, monkeypatch):
    from jobqueue.services import claiming

    enqueue()
    worker = register("w1", capacity=2)
    [c] = claim(worker)
    real = claiming._candidates

    def fails(*args, **kwargs):
        raise RuntimeError("the claim broke after reading the job classes")

    monkeypatch.setattr(claiming, "_candidates", fails)
    spec = {"payload": {}, "source": "s", "agent": "a", "runner": "shell"}
    with pytest.raises(RuntimeError, match="the claim broke"), transaction.atomic():
        # A class new to the process, made in the finish's transaction (a follow-up's, in life), which
        # the claim reads into its cache before it fails; w1 may take it.
        services.job_enqueue_in(key="other", project="other", **spec)
        services.attempt_finish_and_claim.body(
            attempt_id=c.attempt_id, token=c.token, outcome="succeeded", worker_id=worker.worker_id, session=worker.session
        )
    monkeypatch.setattr(claiming, "_candidates", real)
    gpu, _ = services.job_enqueue(key="gpu", project="p", capabilities=["gpu"], **spec)  # takes the rolled-back id
    assert claim(worker) == []  # w1 has no gpu: had the cache kept the rolled-back class, it would claim it
    assert Job.objects.get(pk=gpu.pk).state == JobState.QUEUED


# ------------------------------------------------------------------ the job's last writes, carried

LAST = {"key": "step:last", "state": "done", "value": {"output": "ok"}}


def _records(job_id: int) -> dict:
    return {key: (r.state, r.value) for key, r in services.records_of_job(job_id).items()}


def test_the_finish_carries_its_jobs_last_record_and_log_ends_under_one_read_of_the_attempt(clock):
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    ends = [{"stream": "quiet", "offset": 0, "text": ""}, {"stream": "last", "offset": 0, "text": "bye\n"}]
    with CaptureQueriesContext(connection) as queries:
        done = _finish_and_claim(worker, c, max_jobs=0, record=LAST, log_ends=ends)
    assert (done.job_state, done.refused) == (JobState.SUCCEEDED, ())
    assert _records(job.pk) == {"step:last": ("done", {"output": "ok"})}
    streams = {s.name: (s.received, s.ended) for s in selectors.log_streams(job_id=job.pk)}
    assert streams == {"quiet": (0, True), "last": (4, True)}
    fenced = [q["sql"] for q in queries.captured_queries if "a.token_hash" in q["sql"]]
    assert len(fenced) == 1  # the finish's read of the attempt fences the writes it carries too
    # The quiet stream begins ended (one insert); the other is ended by the update of its append.
    assert sum('UPDATE queue_logstream' in q["sql"] for q in queries.captured_queries) == 1


def test_a_carried_write_that_is_refused_is_named_and_the_rest_stands(clock):
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    ends = [{"stream": "bad name!", "offset": 0, "text": ""}, {"stream": "good", "offset": 0, "text": ""}]
    done = _finish_and_claim(worker, c, max_jobs=0, record=LAST, log_ends=ends)
    assert done.job_state == JobState.SUCCEEDED
    [why] = done.refused
    assert why.startswith("log stream 'bad name!'") and "stream must be" in why
    assert [s.name for s in selectors.log_streams(job_id=job.pk)] == ["good"]
    assert "step:last" in _records(job.pk)


def test_a_finish_sent_again_writes_nothing_it_carries(clock):
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    _finish_and_claim(worker, c, max_jobs=0)
    again = _finish_and_claim(worker, c, max_jobs=0, record=LAST, log_ends=[{"stream": "late", "offset": 0, "text": ""}])
    assert again.job_state == JobState.SUCCEEDED  # the same finish again: the same answer
    assert _records(job.pk) == {} and selectors.log_streams(job_id=job.pk) == []


def test_many_finishes_carry_each_its_own_writes(clock):
    jobs = [enqueue(), enqueue()]
    worker = register("w1", capacity=2)
    c1, c2 = claim(worker, max_jobs=2)
    call = {"outcome": "succeeded", "worker_id": worker.worker_id, "session": worker.session, "max_jobs": 0}
    calls = [
        {**call, "attempt_id": c1.attempt_id, "token": c1.token, "record": LAST},
        {**call, "attempt_id": c2.attempt_id, "token": c2.token, "log_ends": [{"stream": "s", "offset": 0, "text": "x"}]},
    ]
    with transaction.atomic():
        answers = services.attempt_finish_and_claim.body.many(calls)
    assert [(a.job_state, a.refused, e) for a, e in answers] == [(JobState.SUCCEEDED, (), None)] * 2
    assert {c1.job_id, c2.job_id} == {job.pk for job in jobs}
    assert _records(c1.job_id) == {"step:last": ("done", {"output": "ok"})} and _records(c2.job_id) == {}
    assert [s.name for s in selectors.log_streams(job_id=c2.job_id)] == ["s"]
    assert selectors.log_streams(job_id=c1.job_id) == []


def test_a_carried_log_end_past_the_attempts_limit_writes_no_stream(clock, monkeypatch):
    monkeypatch.setattr("jobqueue.services.logs.MAX_LOG_BYTES_PER_ATTEMPT", 3)
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    done = _finish_and_claim(worker, c, max_jobs=0, log_ends=[{"stream": "last", "offset": 0, "text": "four"}])
    assert done.job_state == JobState.SUCCEEDED
    [why] = done.refused
    assert why.startswith("log stream 'last'") and "bytes of logs" in why
    assert selectors.log_streams(job_id=job.pk) == []  # refused before the stream was begun


def test_a_malformed_carried_write_is_refused_by_name(clock):
    worker = register("w1")
    enqueue()
    [c] = claim(worker)
    done = _finish_and_claim(worker, c, max_jobs=0, record={"state": "done"}, log_ends=["not an object"])
    assert done.job_state == JobState.SUCCEEDED and len(done.refused) == 2
    assert "key must be" in done.refused[0] and "must be an object" in done.refused[1]
