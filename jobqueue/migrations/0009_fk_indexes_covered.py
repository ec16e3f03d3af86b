"""Three foreign keys lose the index Django gives each: an index that leads with
the same column covers every lookup by it (attempt (job, number), attempt
(worker, state), jobevent (job, id)), and each index is one more write per
claim, finish or event. Dropped by name, since on SQLite AlterField would copy
the whole table to drop an index; on PostgreSQL CONCURRENTLY (outside a
transaction), so live claims are not queued behind a table lock, and with the
varchar_pattern_ops twin Django made for attempt.worker (a text key)."""

import django.db.models.deletion
from django.db import migrations, models

# (name, its CREATE INDEX columns); the last one exists on PostgreSQL only.
INDEXES = [
    ("queue_attempt_job_id_16e458ae", 'ON "queue_attempt" ("job_id")'),
    ("queue_attempt_worker_id_513ec850", 'ON "queue_attempt" ("worker_id")'),
    ("queue_jobevent_job_id_841572be", 'ON "queue_jobevent" ("job_id")'),
    ("queue_attempt_worker_id_513ec850_like", 'ON "queue_attempt" ("worker_id" varchar_pattern_ops)'),
]


def _names(schema_editor):
    postgres = schema_editor.connection.vendor == "postgresql"
    return [(name, on) for name, on in INDEXES if postgres or not name.endswith("_like")], postgres


def drop(apps, schema_editor):
    indexes, postgres = _names(schema_editor)
    for name, _on in indexes:
        schema_editor.execute(f'DROP INDEX {"CONCURRENTLY " if postgres else ""}IF EXISTS "{name}"')


def restore(apps, schema_editor):
    indexes, postgres = _names(schema_editor)
    for name, on in indexes:
        schema_editor.execute(f'CREATE INDEX {"CONCURRENTLY " if postgres else ""}IF NOT EXISTS "{name}" {on}')


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0008_retry_forget_audit")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(drop, restore)],
            state_operations=[
                migrations.AlterField(
                    model_name="attempt",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="attempts", to="queue.job"
                    ),
                ),
                migrations.AlterField(
                    model_name="attempt",
                    name="worker",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name="attempts", to="queue.worker"
                    ),
                ),
                migrations.AlterField(
                    model_name="jobevent",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="events", to="queue.job"
                    ),
                ),
            ],
        )
    ]
