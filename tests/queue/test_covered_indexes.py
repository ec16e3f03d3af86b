"""The foreign keys whose lookups a wider index serves have no index of their own
(queue migrations 0009 and 0010, workflows 0003): each would be one more write per
claim, finish, event, record, log stream, step run or instance. Nor has the job's class
(queue 0011), whose look-ups are all of queued jobs: one write fewer per enqueue. An
event's attempt is indexed only where it has one (queue 0012), and a lookup by an attempt
still uses that index; a job's current attempt is unique only where it is set (queue 0013),
which still refuses one attempt for two jobs; an event's time is indexed only for the events
that settle a job (queue 0014), and the dashboard's one lookup by time reads that index. Read from the database itself, so a migration that names the wrong
index fails here."""

import re

import pytest
from django.db import IntegrityError, connection, transaction

from jobqueue import services
from jobqueue.models import Job, JobEvent
from jobqueue.selectors.dashboard import outcomes_per_minute
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def indexes_on(table: str) -> dict[str, list[str]]:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    return {name: c["columns"] for name, c in constraints.items() if c["index"] or c["unique"]}


@pytest.mark.parametrize(("table", "column", "covered_by"), [
    ("queue_attempt", "job_id", ["job_id", "number"]),
    ("queue_attempt", "worker_id", ["worker_id", "state"]),
    ("queue_jobevent", "job_id", ["job_id", "id"]),
    ("queue_jobrecord", "job_id", ["job_id", "key"]),
    ("queue_logstream", "attempt_id", ["attempt_id", "name"]),
    ("queue_logstream", "job_id", ["job_id", "id"]),
    ("workflows_steprun", "instance_id", ["instance_id", "attempt_number", "step_id"]),
    ("workflows_workflowinstance", "task_id", ["task_id", "generation", "workflow"]),
])  # fmt: skip
def test_a_foreign_key_led_by_a_wider_index_has_none_of_its_own(table, column, covered_by):
    indexes = indexes_on(table)
    assert [name for name, columns in indexes.items() if columns == [column]] == []
    assert covered_by in indexes.values()


def test_a_jobs_class_has_no_index_of_its_own_the_claim_order_serves_its_queued_look_ups():
    indexes = indexes_on("queue_job")  # (migration 0011)
    assert [name for name, columns in indexes.items() if columns == ["requirements_id"]] == []
    assert ["requirements_id", "priority", "available_at", "id"] in indexes.values()


def index_definition(name: str) -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT sql FROM sqlite_master WHERE name = %s", [name])
        else:
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = %s", [name])
        return cursor.fetchone()[0]


def test_an_events_attempt_is_indexed_only_where_it_has_one_and_its_lookups_use_that():
    indexes = indexes_on("queue_jobevent")  # (migration 0012)
    assert [name for name, columns in indexes.items() if columns == ["attempt_id"]] == ["jobevent_attempt"]
    definition = index_definition("jobevent_attempt")
    assert "attempt_id" in definition and "IS NOT NULL" in definition.upper()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # an empty table: the plan must still be able to use it
        # An attempt's events, and the SET NULL of a deleted attempt's (Django's collector: IN).
        for where in ("attempt_id = 7", "attempt_id IN (7, 8)"):
            cursor.execute(f"EXPLAIN {'QUERY PLAN ' if connection.vendor == 'sqlite' else ''}SELECT id FROM queue_jobevent WHERE {where}")
            plan = " ".join(str(cell) for row in cursor.fetchall() for cell in row)
            assert re.search(r"\bjobevent_attempt\b", plan), (where, plan)  # the name itself, not the old index's


def test_a_jobs_current_attempt_is_unique_where_set_and_nowhere_else(clock):
    definition = index_definition("job_current_attempt_unique")  # (migration 0013)
    assert "UNIQUE" in definition.upper() and "current_attempt_id" in definition and "IS NOT NULL" in definition.upper()
    assert [name for name, columns in indexes_on("queue_job").items() if columns == ["current_attempt_id"]] == [
        "job_current_attempt_unique"
    ]
    _, second, third = enqueue(), enqueue(), enqueue()  # three jobs without an attempt: NULLs take no entry
    [leased] = claim(register("w1"))
    assert Job.objects.filter(current_attempt__isnull=True).count() == 2
    other = second if leased.job_id != second.pk else third
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=other.pk).update(current_attempt_id=leased.attempt_id)  # one attempt, two jobs
    assert Job.objects.filter(current_attempt_id=leased.attempt_id).count() == 1


def test_an_events_time_is_indexed_only_for_settling_events_and_the_dashboard_reads_that(clock):
    indexes = indexes_on("queue_jobevent")  # (migration 0014)
    assert [name for name, columns in indexes.items() if columns == ["at"]] == ["jobevent_settled_at"]
    definition = index_definition("jobevent_settled_at")
    assert all(kind in definition for kind in ("'finished'", "'expired'", "'cancelled'")) and "enqueued" not in definition
    enqueue()
    [leased] = claim(register("w1"))
    services.attempt_finish(attempt_id=leased.attempt_id, token=leased.token, outcome="succeeded", clock=clock)
    assert sorted(JobEvent.objects.values_list("kind", flat=True)) == ["claimed", "enqueued", "finished"]
    ran = []

    def record(execute, sql, params, many, context):
        ran.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        [minute] = outcomes_per_minute(now=clock.now(), minutes=1)
    assert minute["succeeded"] == 1  # counted from the finished event alone
    [(query, params)] = [(sql, params) for sql, params in ran if "queue_jobevent" in sql]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: the plan must still be able to use it
        # The query as it ran, with its parameters bound as they were: SQLite takes a partial
        # index only for a condition in the statement's text, never one in a bound parameter.
        cursor.execute(f"EXPLAIN {'QUERY PLAN ' if connection.vendor == 'sqlite' else ''}{query}", params)
        plan = " ".join(str(cell) for row in cursor.fetchall() for cell in row)
    assert re.search(r"\bjobevent_settled_at\b", plan), plan
