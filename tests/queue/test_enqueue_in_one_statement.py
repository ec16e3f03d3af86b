"""On PostgreSQL, `job_enqueue` of a job whose class exists is one statement
outside any transaction of ours: the job, its `enqueued` event and its wake
(NOTIFY) commit as one. These pin that: it is committed when the call
returns (another connection sees the job and its event), nothing else was
sent, the NOTIFY carries the job's class, the server prepared the statement
once for the connection, and what the single statement
cannot do (a key already queued, a class never seen, an affinity key) still goes the transactional way with the same
answers. Run on PostgreSQL by scripts/test; on SQLite only the answers are checked."""

import psycopg
import pytest
from django.db import connection

from jobqueue import services
from jobqueue.models import Job, JobEvent, RequirementSet
from jobqueue.wakeup import notifier
from jobqueue.wakeup.emit import CHANNEL, decode

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = {"payload": {"n": 1}, "project": "p", "source": "s", "agent": "a", "runner": "shell", "capabilities": ["x"]}


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite enqueues in a transaction")


def statements_of(call) -> tuple[object, list[str]]:
    seen: list[str] = []

    def spy(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        return call(), seen


def test_a_job_of_a_known_class_is_one_committed_statement_with_its_event_and_wake(
    postgres_only, live_database_url, monkeypatch
):
    services.job_enqueue(key="first", **SPEC)  # the class exists from here on
    published = []
    monkeypatch.setattr(notifier, "publish", published.append)  # this process's own waiters
    with psycopg.connect(live_database_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        (job, created), seen = statements_of(lambda: services.job_enqueue(key="second", **SPEC))
        assert created and len(seen) == 1 and "pg_notify" in seen[0]
        assert not connection.in_atomic_block
        # Committed on return: another connection sees the job and its event.
        with psycopg.connect(live_database_url) as other:
            assert other.execute("SELECT state FROM queue_job WHERE key = 'second'").fetchall() == [("queued",)]
            assert other.execute("SELECT kind FROM queue_jobevent WHERE job_id = %s", [job.pk]).fetchall() == [
                ("enqueued",)
            ]
        [message] = list(listener.notifies(timeout=5, stop_after=1))
    _sender, wake = decode(message.payload)
    assert (wake.requirements, wake.count, wake.worker_id, wake.delay) == (job.requirements_id, 1, None, 0.0)
    assert wake.needs == (None, frozenset(), frozenset({"x"}))
    assert [w.requirements for w in published] == [job.requirements_id]
    stored = Job.objects.get(pk=job.pk)
    assert {f.attname: getattr(stored, f.attname) for f in Job._meta.concrete_fields} == {
        f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields
    }


def test_the_statement_is_prepared_once_per_connection_and_run_from_its_plan(postgres_only):
    for n in range(8):
        services.job_enqueue(key=f"k{n}", **SPEC)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT SUM(generic_plans + custom_plans) FROM pg_prepared_statements WHERE statement LIKE '%%pg_notify%%'"
        )  # summed: psycopg prepares again for other parameter types (an int past int2, say)
        # Prepared, and run from it by every call (the first found no class, so wrote nothing,
        # and took the transaction).
        assert cursor.fetchall() == [(8,)]


def test_a_key_already_queued_answers_its_job_and_writes_nothing():
    first, created = services.job_enqueue(key="k", **SPEC)
    again, created_again = services.job_enqueue(key="k", **{**SPEC, "payload": {"n": 2}})
    assert created and not created_again and again.pk == first.pk and again.payload == {"n": 1}
    assert Job.objects.count() == 1 and JobEvent.objects.filter(kind="enqueued").count() == 1


def test_a_class_never_seen_is_created_by_the_transactional_way():
    job, created = services.job_enqueue(key="k", **{**SPEC, "labels": ["gpu"]})
    assert created and RequirementSet.objects.get(pk=job.requirements_id).labels == ["gpu"]
    assert JobEvent.objects.filter(job=job, kind="enqueued").count() == 1


def test_an_affinity_job_takes_the_transactional_way(postgres_only):
    services.job_enqueue(key="first", **SPEC)
    (job, created), seen = statements_of(lambda: services.job_enqueue(key="pinned", affinity_key="task:1", **SPEC))
    assert created and job.affinity_key == "task:1"
    assert not any("pg_notify(CAST" in sql for sql in seen)  # the pins are read, then NOTIFY goes at COMMIT
