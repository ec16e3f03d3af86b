"""A job's current attempt stays unique, but only where it is set: as a one-to-one it had an
index entry for every job, NULL included, and every enqueue wrote one that no lookup reads
(a queued job has no attempt, nor has a finished one whose attempt was re-queued). Now a
partial unique index: one index page fewer per enqueue.

On PostgreSQL the partial index is built CONCURRENTLY first (live claims and finishes go on
writing queue_job meanwhile), and then the old UNIQUE constraint is dropped: a catalog change,
brief however many jobs there are. The foreign key is left as it is (Django's AlterField would
drop it and add it again, checking every row under lock). On SQLite the column's UNIQUE is part
of the table's definition, so the table is copied without it (Django's remake), in one
transaction with the new index: all of it or nothing."""

import django.db.models.deletion
from django.db import migrations, models, transaction

from jobqueue.covered_indexes import create_index, drop_index

NEW = ("job_current_attempt_unique", 'ON "queue_job" ("current_attempt_id") WHERE "current_attempt_id" IS NOT NULL')
OLD = "queue_job_current_attempt_id_key"  # the one-to-one's constraint, as PostgreSQL named it

TO_FOREIGN_KEY = migrations.AlterField(
    model_name="job",
    name="current_attempt",
    field=models.ForeignKey(
        blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL,
        related_name="+", to="queue.attempt",
    ),
)  # fmt: skip
UNIQUE_WHERE_SET = migrations.AddConstraint(
    model_name="job",
    constraint=models.UniqueConstraint(
        condition=models.Q(("current_attempt__isnull", False)), fields=("current_attempt",), name=NEW[0]
    ),
)


class UniqueOnlyWhereSet(migrations.operations.base.Operation):
    """TO_FOREIGN_KEY and UNIQUE_WHERE_SET in the models' state; in the database, as the
    module docstring says."""

    reversible = True

    def state_forwards(self, app_label, state):
        TO_FOREIGN_KEY.state_forwards(app_label, state)
        UNIQUE_WHERE_SET.state_forwards(app_label, state)

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            create_index(schema_editor, *NEW, unique=True)
            for name in _old_unique_constraints(schema_editor):
                schema_editor.execute(f'ALTER TABLE "queue_job" DROP CONSTRAINT "{name}"')
            return
        with transaction.atomic(using=schema_editor.connection.alias):
            TO_FOREIGN_KEY.database_forwards(app_label, schema_editor, from_state, to_state)
            create_index(schema_editor, *NEW, unique=True)  # IF NOT EXISTS: the copy may have kept it, run twice

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            create_index(schema_editor, OLD, 'ON "queue_job" ("current_attempt_id")', unique=True)
            schema_editor.execute(f'ALTER TABLE "queue_job" ADD CONSTRAINT "{OLD}" UNIQUE USING INDEX "{OLD}"')
            drop_index(schema_editor, NEW[0])
            return
        with transaction.atomic(using=schema_editor.connection.alias):
            TO_FOREIGN_KEY.database_backwards(app_label, schema_editor, from_state, to_state)
            drop_index(schema_editor, NEW[0])  # after the copy, which makes the later state's indexes again

    def describe(self):
        return "A job's current attempt: a foreign key, unique only where set"


def _old_unique_constraints(schema_editor) -> list[str]:
    """The UNIQUE constraints on current_attempt_id alone, whatever they were named."""
    with schema_editor.connection.cursor() as cursor:
        constraints = schema_editor.connection.introspection.get_constraints(cursor, "queue_job")
    return [
        name for name, found in constraints.items()
        if found["unique"] and not found["index"] and not found["primary_key"] and found["columns"] == ["current_attempt_id"]
    ]  # fmt: skip


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0012_jobevent_attempt_index_partial")]

    operations = [UniqueOnlyWhereSet()]
