"""The foreign keys whose lookups a wider index serves have no index of their own
(queue migrations 0009 and 0010, workflows 0003): each would be one more write per
claim, finish, event, record, log stream, step run or instance. Nor has the job's class
(queue 0011), whose look-ups are all of queued jobs: one write fewer per enqueue. Read
from the database itself, so a migration that names the wrong index fails here."""

import pytest
from django.db import connection

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
