"""The rows a dispatch batch writes (services.items_dispatch), as plain statements.

A batch inserts hundreds of tasks and instances at once; the ORM's bulk_create
spends more on preparing each field of each object than the database spends on
the insert (measured: about 40 % of a batch's CPU), so these build one
multi-row INSERT … RETURNING per chunk and set the ids on the model objects
the batch goes on with. Each insert answers its rows' natural keys with their
ids, so nothing depends on the order in which a backend returns them. SQL that
SQLite and PostgreSQL both accept; values only ever as parameters.
"""

import json

from django.db import connection

from jobqueue import sql

from .models import Task, WorkflowInstance

CHUNK = 500  # rows per statement: far below either backend's limit on parameters

_TASK_COLUMNS = ("source", "item_key", "generation", "title", "body", "payload", "content_hash", "created_at", "updated_at")
_INSTANCE_COLUMNS = ("task_id", "generation", "workflow", "created_at")


def _link_jobs(rows: int) -> str:
    # Typed cells, as sql.lease's: a VALUES list's cells take no type from the table they update
    # (on PostgreSQL a parameter bound on the server would be text, which equals no bigint).
    cells = ", ".join(["(CAST(%s AS bigint), CAST(%s AS bigint))"] * rows)
    table = WorkflowInstance._meta.db_table
    return f"UPDATE {table} SET job_id = v.column1 FROM (VALUES {cells}) AS v WHERE {table}.id = v.column2"


def _insert(table: str, columns: tuple[str, ...], rows: int, returning: str) -> str:
    cells = f"({sql.placeholders(len(columns))})"
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {', '.join([cells] * rows)} RETURNING {returning}"


def _stored(obj) -> None:
    """Mark a model object as a row read from the database (its save() updates)."""
    obj._state.adding, obj._state.db = False, connection.alias


def insert_tasks(tasks: list[Task]) -> None:
    """Insert new tasks (unique item keys of one source); sets their ids."""
    with connection.cursor() as cursor:
        for start in range(0, len(tasks), CHUNK):
            chunk = tasks[start : start + CHUNK]
            params = []
            for t in chunk:
                params += [t.source, t.item_key, t.generation, t.title, t.body, json.dumps(t.payload),
                           t.content_hash, sql.ts(t.created_at), sql.ts(t.updated_at)]  # fmt: skip
            cursor.execute(_insert(Task._meta.db_table, _TASK_COLUMNS, len(chunk), "id, item_key"), params)
            ids = {key: pk for pk, key in cursor.fetchall()}
            for t in chunk:
                t.pk = ids[t.item_key]
                _stored(t)


def insert_instances(instances: list[WorkflowInstance]) -> None:
    """Insert new instances (one generation per task); sets their ids."""
    with connection.cursor() as cursor:
        for start in range(0, len(instances), CHUNK):
            chunk = instances[start : start + CHUNK]
            params = [p for i in chunk for p in (i.task_id, i.generation, i.workflow, sql.ts(i.created_at))]
            table = WorkflowInstance._meta.db_table
            cursor.execute(_insert(table, _INSTANCE_COLUMNS, len(chunk), "id, task_id, workflow"), params)
            ids = {(task_id, workflow): pk for pk, task_id, workflow in cursor.fetchall()}
            for i in chunk:
                i.pk = ids[i.task_id, i.workflow]
                _stored(i)


def link_jobs(instances: list[WorkflowInstance]) -> None:
    """Set each instance's job: one UPDATE … FROM (VALUES …) per chunk (bulk_update's CASE costs
    the ORM more than the batch's inserts, and an executemany steps its statement once a row)."""
    with connection.cursor() as cursor:
        for start in range(0, len(instances), CHUNK):
            chunk = instances[start : start + CHUNK]
            cursor.execute(_link_jobs(len(chunk)), [p for i in chunk for p in (i.job_id, i.pk)])
