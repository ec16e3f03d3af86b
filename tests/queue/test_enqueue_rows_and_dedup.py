"""Enqueue writes a job in one insert that finds its class by digest; these pin what
that insert must keep: the returned Job is the row as stored, a key already in the
queue (or earlier in the same batch) writes nothing, a class is created when no
job had it (also after a rolled-back transaction created it first), and each
class's new jobs wake as many waiters as there are jobs. Run on SQLite and
PostgreSQL (tests/queue is in scripts/test's PostgreSQL suite)."""

import pytest
from django.db import transaction

from jobqueue import services
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import Affinity, Job, JobEvent, RequirementSet
from jobqueue.services import jobs
from jobqueue.types import Retry
from tests.factories import register, snapshot

pytestmark = pytest.mark.django_db

SPEC = {"payload": {"n": 1}, "project": "p", "source": "s", "agent": "a", "runner": "shell"}


def spec(key: str, **fields) -> dict:
    return {**SPEC, "key": key, **fields}


def enqueue_many(specs: list[dict]) -> list[tuple[Job, bool]]:
    with transaction.atomic(durable=True):
        return services.jobs_enqueue_in(specs)


def columns(job: Job) -> dict:
    return {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}


def test_the_returned_job_is_the_row_as_stored(clock):
    follow_ups = {"failed": [spec("k:hook:failed")]}
    job, created = services.job_enqueue(
        **spec("k", payload={"text": "a\x00b", "lone": "\ud800"}, pool="", labels=["gpu", "gpu", "arm"],
               capabilities=["x"], affinity_key="task:1", priority=3, max_attempts=7,
               retry=Retry(max_attempts=2, backoff=3.0, backoff_max=9.0), follow_ups=follow_ups),
    )  # fmt: skip
    assert created
    stored = Job.objects.get(pk=job.pk)
    assert columns(job) == columns(stored)
    assert stored.payload == {"text": "a\ufffdb", "lone": "\ufffd"}
    assert (stored.pool, stored.available_at, stored.created_at) == (None, clock.now(), clock.now())
    assert (stored.state, stored.attempt_count, stored.summary, stored.follow_ups) == ("queued", 0, {}, follow_ups)
    assert (stored.requirements.labels, stored.requirements.capabilities) == (["arm", "gpu"], ["x"])
    assert list(JobEvent.objects.filter(job=job).values_list("kind", flat=True)) == ["enqueued"]
    job.reason = "saved"
    job.save()  # the returned object updates its row, as one read from the database would
    assert Job.objects.count() == 1 and Job.objects.get(pk=job.pk).reason == "saved"


def test_keys_already_queued_or_earlier_in_the_batch_create_nothing(clock):
    (first, _), = enqueue_many([spec("old")])
    before = snapshot()
    results = enqueue_many([spec("new"), spec("old", priority=9), spec("new", agent="other")])
    assert [created for _, created in results] == [True, False, False]
    new, old, new_again = (job for job, _ in results)
    assert old.pk == first.pk and new_again.pk == new.pk
    after = snapshot()
    assert [row for row in after["Job"] if row["key"] == "old"] == before["Job"]  # the old job untouched
    assert len(after["Job"]) == 2 and len(after["JobEvent"]) == 2  # one job and one event more: "new"'s


def test_a_key_given_twice_is_the_first_spec_even_when_only_the_second_has_a_known_class(clock):
    enqueue_many([spec("known")])  # the plain class exists; the "gpu" one does not yet
    results = enqueue_many([spec("twice", labels=["gpu"], priority=1), spec("twice", priority=2)])
    (first, created), (second, again) = results
    assert (created, again) == (True, False) and second.pk == first.pk
    stored = Job.objects.get(key="twice")
    assert columns(first) == columns(stored)  # what was returned is what was stored
    assert (stored.priority, stored.requirements.labels) == (1, ["gpu"])  # the first spec's


def test_a_class_no_job_had_is_created_once_for_all_its_jobs(clock):
    results = enqueue_many([spec(f"k{i}", labels=["gpu"]) for i in range(3)] + [spec("plain")])
    assert all(created for _, created in results)
    assert RequirementSet.objects.count() == 2
    assert len({job.requirements_id for job, _ in results[:3]}) == 1


def test_a_class_created_in_a_rolled_back_transaction_is_created_again(clock):
    # A cache of classes by digest filled inside a transaction that then rolled back would
    # hand out the id of a row that is gone (or, on SQLite, that a different class gets next).
    with pytest.raises(RuntimeError), transaction.atomic(durable=True):
        services.job_enqueue_in(**spec("gone", labels=["gpu"]))
        raise RuntimeError("rolled back")
    assert not RequirementSet.objects.exists()
    services.job_enqueue(**spec("other", labels=["arm"]))  # SQLite hands it the rolled-back id
    job, created = services.job_enqueue(**spec("gone", labels=["gpu"]))
    assert created and Job.objects.get(pk=job.pk).requirements.labels == ["gpu"]


def test_a_bad_spec_refuses_the_whole_batch_before_anything_is_written(clock):
    before = snapshot()
    with pytest.raises(InvalidRequest, match="payload"):
        enqueue_many([spec("good"), spec("bad", payload=["not", "an", "object"])])
    assert snapshot() == before


def test_batches_larger_than_one_insert_enqueue_every_job(clock, monkeypatch):
    monkeypatch.setattr(jobs, "INSERT_CHUNK", 2)
    results = enqueue_many([spec(f"k{i}") for i in range(5)] + [spec("k0")])
    assert [created for _, created in results] == [True] * 5 + [False]
    assert Job.objects.count() == JobEvent.objects.count() == 5


def test_new_jobs_wake_once_per_class_and_pinned_worker_for_as_many_waiters_as_jobs(clock, monkeypatch):
    register("w1")
    Affinity.objects.create(key="task:1", worker_id="w1", pinned_at=clock.now())
    wakes = []
    real_emit = jobs.emit
    monkeypatch.setattr(jobs, "emit", lambda cursor, wake: (wakes.append(wake), real_emit(cursor, wake)))
    enqueue_many(
        [spec("a1"), spec("a2"), spec("gpu", labels=["gpu"]), spec("a3"),
         spec("pinned", affinity_key="task:1"), spec("free", affinity_key="task:2")]
    )  # fmt: skip
    shapes = sorted((wake.needs[1] == {"gpu"}, wake.worker_id or "", wake.count) for wake in wakes)
    assert shapes == [(False, "", 4), (False, "w1", 1), (True, "", 1)]
    wakes.clear()
    enqueue_many([spec("a1"), spec("a2")])  # nothing new: nobody to wake
    assert wakes == []
