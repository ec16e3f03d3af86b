"""`job_enqueue` outside any transaction of the caller's takes a shorter way for a
new job of a class already known: on PostgreSQL one statement, on SQLite one
BEGIN IMMEDIATE … COMMIT of its own, without transaction.atomic around it.
Either way the job, its `enqueued` event and its wake commit as one. These pin
that: it is committed when the call returns (another connection sees the job
and its event), nothing else was sent, the wake carries the job's class and
reaches this process's waiters only after the commit, a failure anywhere in
the transaction leaves nothing written and the connection usable, a key
already queued answers its job, and what the short way cannot do (a class
never seen, an affinity key) goes the transactional way. The PostgreSQL tests
run there by scripts/test; the rest run on both."""

import sqlite3

import psycopg
import pytest
from django.db import IntegrityError, OperationalError, connection

from jobqueue import services
from jobqueue.exceptions import Unavailable
from jobqueue.models import Job, JobEvent, RequirementSet, Wakeup
from jobqueue.wakeup import notifier
from jobqueue.wakeup.emit import CHANNEL, decode

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = {"payload": {"n": 1}, "project": "p", "source": "s", "agent": "a", "runner": "shell", "capabilities": ["x"]}


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: its single statement")


@pytest.fixture
def sqlite_only():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: its transaction of its own")


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


def _no_transaction_left() -> bool:
    return connection.vendor != "sqlite" or not connection.connection.in_transaction


def test_a_key_already_queued_answers_its_job_and_writes_nothing():
    first, created = services.job_enqueue(key="k", **SPEC)
    again, created_again = services.job_enqueue(key="k", **{**SPEC, "payload": {"n": 2}})
    assert created and not created_again and again.pk == first.pk and again.payload == {"n": 1}
    assert Job.objects.count() == 1 and JobEvent.objects.filter(kind="enqueued").count() == 1
    assert _no_transaction_left()


def test_a_class_never_seen_is_created_by_the_transactional_way():
    job, created = services.job_enqueue(key="k", **{**SPEC, "labels": ["gpu"]})
    assert created and RequirementSet.objects.get(pk=job.requirements_id).labels == ["gpu"]
    assert JobEvent.objects.filter(job=job, kind="enqueued").count() == 1
    assert _no_transaction_left()


def test_an_affinity_job_takes_the_transactional_way():
    services.job_enqueue(key="first", **SPEC)
    (job, created), seen = statements_of(lambda: services.job_enqueue(key="pinned", affinity_key="task:1", **SPEC))
    assert created and job.affinity_key == "task:1"
    # The wake goes to the key's worker, so the pins are read (the short way reads none), and
    # PostgreSQL's NOTIFY goes at COMMIT, not in the insert.
    assert any("queue_affinity" in sql for sql in seen)
    assert not any("pg_notify(CAST" in sql for sql in seen)
    assert _no_transaction_left()


def _fields(job: Job) -> dict:
    return {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}


def _other_connection() -> sqlite3.Connection:
    """A second connection to the test database: it sees only what was committed."""
    return sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)


def _written() -> tuple[int, int, int]:
    return Job.objects.count(), JobEvent.objects.count(), Wakeup.objects.count()


def test_sqlite_a_job_of_a_known_class_is_one_transaction_of_its_own(sqlite_only, monkeypatch):
    services.job_enqueue(key="first", **SPEC)  # the class exists from here on
    heard = []

    def publish(wake):  # this process's waiters hear the wake only once the job is there for everyone
        with _other_connection() as other:
            seen = other.execute("SELECT state FROM queue_job WHERE key = 'second'").fetchall()
        heard.append((wake, connection.connection.in_transaction, seen))

    monkeypatch.setattr(notifier, "publish", publish)
    (job, created), seen = statements_of(lambda: services.job_enqueue(key="second", **SPEC))
    assert created
    assert [sql.split(None, 2)[:2] for sql in seen] == [
        ["BEGIN", "IMMEDIATE"], ["WITH", "v"], ["INSERT", "INTO"], ["INSERT", "INTO"], ["COMMIT"],
    ]  # fmt: skip
    assert "queue_jobevent" in seen[2] and "queue_wakeup" in seen[3]
    assert not connection.in_atomic_block and not connection.connection.in_transaction
    with _other_connection() as other:
        assert other.execute("SELECT kind FROM queue_jobevent WHERE job_id = ?", [job.pk]).fetchall() == [("enqueued",)]
        [(message,)] = other.execute("SELECT message FROM queue_wakeup ORDER BY id DESC LIMIT 1").fetchall()
    [(wake, in_transaction, visible)] = heard
    assert not in_transaction and visible == [("queued",)]
    _sender, written = decode(message)
    for w in (wake, written):  # the same wake, told here and written for the other processes
        assert (w.requirements, w.count, w.worker_id, w.delay) == (job.requirements_id, 1, None, 0.0)
        assert w.needs == (None, frozenset(), frozenset({"x"}))
    assert _fields(Job.objects.get(pk=job.pk)) == _fields(job)


@pytest.mark.parametrize(
    "when, statement",
    [
        ("before", "queue_jobevent"), ("before", "queue_wakeup"), ("before", "COMMIT"),
        # Raised once the statement took effect (a wrapper, a signal): BEGIN's included, else
        # every later call on this connection would fail.
        ("after", "BEGIN IMMEDIATE"), ("after", "queue_job"), ("after", "queue_jobevent"),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    "error, raised",
    [
        (OperationalError("disk I/O error"), Unavailable),
        (IntegrityError("CHECK constraint failed"), IntegrityError),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ],
)
def test_sqlite_a_failure_inside_the_transaction_writes_nothing(sqlite_only, monkeypatch, when, statement, error, raised):
    services.job_enqueue(key="first", **SPEC)
    before = _written()
    published = []
    monkeypatch.setattr(notifier, "publish", published.append)

    def fail(execute, sql, params, many, context):
        hit = sql.startswith(statement) or f"INTO {statement} " in sql
        if hit and when == "before":
            raise error
        result = execute(sql, params, many, context)
        if hit:
            raise error
        return result

    with connection.execute_wrapper(fail), pytest.raises(raised):
        services.job_enqueue(key="second", **SPEC)
    assert not connection.connection.in_transaction  # rolled back, and the connection usable
    assert _written() == before and published == []
    job, created = services.job_enqueue(key="second", **SPEC)
    assert created and _written() == (before[0] + 1, before[1] + 1, before[2] + 1)


class _RollbackFails:
    """The raw connection, but its ROLLBACK fails."""

    def __init__(self, raw):
        self.raw = raw

    def rollback(self):
        raise sqlite3.OperationalError("disk I/O error (rollback)")

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_sqlite_a_rollback_that_fails_too_closes_the_connection_and_keeps_the_first_error(sqlite_only):
    services.job_enqueue(key="first", **SPEC)
    before = _written()
    raw = connection.connection
    connection.connection = _RollbackFails(raw)  # until the enqueue closes it

    def fail(execute, sql, params, many, context):
        if "queue_wakeup" in sql:
            raise OperationalError("disk I/O error")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail), pytest.raises(Unavailable, match="disk I/O error$"):
        services.job_enqueue(key="second", **SPEC)
    assert connection.connection is None  # closed: its open transaction went with it
    with pytest.raises(sqlite3.ProgrammingError):
        raw.execute("SELECT 1")
    assert _written() == before
    assert services.job_enqueue(key="second", **SPEC)[1]  # on a fresh connection


def test_a_waiter_that_fails_to_hear_a_committed_job_does_not_fail_the_enqueue(monkeypatch, caplog):
    services.job_enqueue(key="first", **SPEC)

    def publish(wake):
        raise RuntimeError("a waiter broke")

    monkeypatch.setattr(notifier, "publish", publish)
    job, created = services.job_enqueue(key="second", **SPEC)  # the short way on either backend
    assert created and Job.objects.filter(pk=job.pk, state="queued").exists()
    assert "telling this process's waiters of a committed wake failed" in caplog.text


def test_sqlite_a_transaction_left_open_on_the_connection_is_not_ours_to_end(sqlite_only):
    """Left open by someone else, it is neither committed nor rolled back by an enqueue:
    the call is refused, and the transaction is still there for its owner to end."""
    services.job_enqueue(key="first", **SPEC)
    before = _written()
    raw = connection.connection
    raw.execute("BEGIN")
    raw.execute("INSERT INTO queue_wakeup (message) VALUES ('left open')")
    try:
        with pytest.raises(Unavailable, match="within a transaction"):
            services.job_enqueue(key="second", **SPEC)
        assert raw.in_transaction
        assert raw.execute("SELECT COUNT(*) FROM queue_wakeup WHERE message = 'left open'").fetchall() == [(1,)]
    finally:
        raw.rollback()
    assert _written() == before


def test_sqlite_a_locked_database_is_unavailable_and_writes_nothing(sqlite_only):
    services.job_enqueue(key="first", **SPEC)
    before = _written()
    raw = connection.connection
    [(timeout,)] = raw.execute("PRAGMA busy_timeout").fetchall()
    raw.execute("PRAGMA busy_timeout = 50")  # not the settings' 30 s
    try:
        with _other_connection() as other:
            other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            with pytest.raises(Unavailable, match="database is locked"):
                services.job_enqueue(key="second", **SPEC)
            other.execute("ROLLBACK")
    finally:
        raw.execute(f"PRAGMA busy_timeout = {timeout}")
    assert not connection.connection.in_transaction and _written() == before
    assert services.job_enqueue(key="second", **SPEC)[1]
