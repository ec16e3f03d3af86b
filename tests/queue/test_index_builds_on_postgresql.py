"""On PostgreSQL the queue's index migrations build CONCURRENTLY, so live claims are not
queued behind a table lock: an interrupted build (which leaves an invalid index that IF NOT
EXISTS would take for a finished one) is built again, and queue 0013 trades the unique
constraint on a job's current attempt for a partial unique index without touching the
foreign key beside it."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from jobqueue.covered_indexes import create_index

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _on_postgresql():
    if connection.vendor != "postgresql":  # read here: the settings point at the test server by now
        pytest.skip("CONCURRENTLY builds are PostgreSQL's (APIARY_TEST_DB=postgres)")


def _valid(name: str):
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
    return row[0] if row else None


def _constraints(column: str) -> dict[str, tuple[str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT con.conname, con.contype, con.oid FROM pg_constraint con"
            " JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = ANY (con.conkey)"
            " WHERE con.conrelid = 'queue_job'::regclass AND a.attname = %s",
            [column],
        )
        return {name: (kind, oid) for name, kind, oid in cursor.fetchall()}


def test_an_index_an_interrupted_build_left_invalid_is_built_again():
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE scratch_dupes (v integer)")
        cursor.execute("INSERT INTO scratch_dupes VALUES (1), (1)")
    try:
        with (
            pytest.raises(Exception, match="could not create unique index"),
            connection.schema_editor(atomic=False) as editor,
        ):
            create_index(editor, "scratch_v", 'ON "scratch_dupes" ("v")', unique=True)
        assert _valid("scratch_v") is False  # left behind, as an interrupted build leaves it
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM scratch_dupes WHERE ctid = (SELECT min(ctid) FROM scratch_dupes)")
        with connection.schema_editor(atomic=False) as editor:
            create_index(editor, "scratch_v", 'ON "scratch_dupes" ("v")', unique=True)
        assert _valid("scratch_v") is True
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE scratch_dupes")


def test_queue_0013_builds_concurrently_and_keeps_the_foreign_key():
    statements: list[str] = []

    def record(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    def migrate(target):
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate([target])

    foreign_key = {name: oid for name, (kind, oid) in _constraints("current_attempt_id").items() if kind == "f"}
    assert len(foreign_key) == 1
    try:
        migrate(("queue", "0012_jobevent_attempt_index_partial"))
        unique = [name for name, (kind, _) in _constraints("current_attempt_id").items() if kind == "u"]
        assert unique, "0012 has a unique constraint on the current attempt"
        with connection.execute_wrapper(record):
            migrate(("queue", "0013_job_current_attempt_unique_partial"))
    finally:
        migrate(MigrationExecutor(connection).loader.graph.leaf_nodes("queue")[0])  # what later tests expect
    after = _constraints("current_attempt_id")
    assert {name: oid for name, (kind, oid) in after.items() if kind == "f"} == foreign_key
    assert not [name for name, (kind, _) in after.items() if kind == "u"]
    assert _valid("job_current_attempt_unique") is True
    assert any("CREATE UNIQUE INDEX CONCURRENTLY" in sql for sql in statements), statements
