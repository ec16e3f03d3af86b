"""A group commit runs a batch's finishes together (attempt_finish's `many`):
one fenced read of all their attempts and one settling of the plain
successes. Whatever the mix, each call must be answered, and leave the
queue, exactly as the same finish made alone would: the same scenario is
played once through the single service and once through `many`, and the
two outcomes are compared row by row. Run on SQLite and PostgreSQL."""

import pytest
from django.db import connection, transaction

from jobqueue import services
from jobqueue.exceptions import StaleAttempt
from jobqueue.models import Attempt, Job, JobEvent
from jobqueue.types import Retry
from tests.factories import claim, enqueue, make_task, register

pytestmark = pytest.mark.django_db

finish_many = services.attempt_finish.body.many


def _scenario(prefix: str) -> tuple[list[dict], list[Job]]:
    """Nine claimed jobs, and the finish calls to make for them in the order a batch would hold them."""
    hook = {"key": f"{prefix}:hook", "payload": {}, "project": "demo", "source": "s", "agent": "a", "runner": "shell",
            "capabilities": ["nobody-here"]}  # fmt: skip
    jobs = [
        enqueue(make_task(item_key=f"{prefix}-{i}"), capabilities=[prefix], **extra)  # only this scenario's worker
        for i, extra in enumerate(
            [{}, {}, {}, {}, {"retry": Retry(max_attempts=3)}, {}, {"follow_ups": {"succeeded": [hook]}}, {}, {}]
        )
    ]
    worker = register(f"w-{prefix}", capabilities=[prefix], capacity=len(jobs))
    claims = {c.job_id: c for c in claim(worker, len(jobs))}
    c = [claims[job.pk] for job in jobs]
    services.attempt_finish(attempt_id=c[3].attempt_id, token=c[3].token, outcome="succeeded", summary={"n": 3})
    services.job_cancel(job_id=jobs[5].pk)  # leased: a cancel is requested, and wins over the finish
    call = lambda k, **kw: {"attempt_id": c[k].attempt_id, "token": c[k].token, "outcome": "succeeded", **kw}  # noqa: E731
    return [
        call(0, summary={"n": 0}),
        call(1, token="not-its-token"),
        call(2, summary={"n": 2}, error="warned\x00"),
        call(3, summary={"n": 3}),  # the same finish again
        call(4, outcome="failed", error="boom"),  # a retry left: queued again
        call(5),
        call(6),  # its follow-up is enqueued with it
        call(7, outcome="no-such-outcome"),
        {"attempt_id": 10**9, "token": "x", "outcome": "succeeded"},
        call(8, summary={"n": 8}),
    ], jobs


def _answer(value):
    return type(value).__name__ if isinstance(value, Exception) else value


def _outcome(prefix: str, jobs: list[Job]) -> list[tuple]:
    """What the scenario's jobs came to, without ids, times or the prefix."""
    rows = []
    for job in Job.objects.filter(pk__in=[j.pk for j in jobs]).order_by("pk"):
        attempts = list(Attempt.objects.filter(job=job).order_by("number").values_list("state", "job_state", "error"))
        kinds = [(e.kind, e.detail.get("outcome"), e.detail.get("job_state")) for e in JobEvent.objects.filter(job=job).order_by("pk")]
        rows.append((job.state, job.summary, job.reason, job.finished_at is None, attempts, kinds))
    rows.append(Job.objects.filter(key=f"{prefix}:hook").count())
    return rows


def test_finishes_run_together_answer_and_write_as_each_would_alone(clock):
    alone_calls, alone_jobs = _scenario("alone")
    alone = []
    for kw in alone_calls:
        try:
            alone.append(_answer(services.attempt_finish(**kw)))
        except Exception as exc:  # noqa: BLE001 - compared below
            alone.append(_answer(exc))

    together_calls, together_jobs = _scenario("together")
    with transaction.atomic():
        together = [_answer(result if error is None else error) for result, error in finish_many(together_calls)]

    assert together == alone == [
        "succeeded", "StaleAttempt", "succeeded", "succeeded", "queued", "cancelled", "succeeded",
        "InvalidRequest", "NotFound", "succeeded",
    ]  # fmt: skip
    assert len(_outcome("alone", alone_jobs)) == 10  # nine jobs and their hook
    assert _outcome("together", together_jobs) == _outcome("alone", alone_jobs)


def test_plain_successes_are_one_read_and_one_settling_whatever_their_number(clock, django_assert_num_queries):
    jobs = [enqueue() for _ in range(5)]
    claims = claim(register("w1", capacity=5), 5)
    calls = [{"attempt_id": c.attempt_id, "token": c.token, "outcome": "succeeded", "summary": {}} for c in claims]
    settling = 1 if connection.vendor == "postgresql" else 3  # attempts, jobs, events
    with transaction.atomic(), django_assert_num_queries(1 + settling):
        assert finish_many(calls) == [("succeeded", None)] * 5
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {"succeeded"}


def test_a_refused_call_among_them_wrote_nothing_of_its_own(clock):
    enqueue(), enqueue()
    a, b = claim(register("w1", capacity=2), 2)
    with transaction.atomic():
        answers = finish_many([
            {"attempt_id": a.attempt_id, "token": "stale", "outcome": "succeeded"},
            {"attempt_id": b.attempt_id, "token": b.token, "outcome": "succeeded"},
        ])  # fmt: skip
    assert isinstance(answers[0][1], StaleAttempt) and answers[1] == ("succeeded", None)
    assert Attempt.objects.get(pk=a.attempt_id).state == "active"
    assert not JobEvent.objects.filter(attempt_id=a.attempt_id, kind="finished").exists()


def test_calls_one_read_cannot_serve_run_one_by_one(clock):
    enqueue()
    [c] = claim(register("w1"))
    call = {"attempt_id": c.attempt_id, "token": c.token, "outcome": "succeeded"}
    with transaction.atomic():  # the same attempt twice: the second is the same finish again
        assert finish_many([call, dict(call)]) == [("succeeded", None), ("succeeded", None)]
    with pytest.raises(TypeError), transaction.atomic():  # an argument the service does not take
        finish_many([call, {**call, "colour": "red"}])
    assert Job.objects.get().state == "succeeded"


def test_with_limits_the_slots_plain_successes_free_are_one_wake_for_as_many_waiters(clock, queue_config, monkeypatch):
    from jobqueue.conf import Limits
    from jobqueue.services import attempts

    queue_config(limits=Limits(defaults={"project": 5}))
    for _ in range(3):
        enqueue()
    claims = claim(register("w1", capacity=3), 3)
    sent = []
    monkeypatch.setattr(attempts, "emit", lambda cursor, wake: sent.append(wake))
    with transaction.atomic():
        finish_many([{"attempt_id": c.attempt_id, "token": c.token, "outcome": "succeeded"} for c in claims])
    assert [(w.requirements, w.count) for w in sent] == [(None, 3)]
