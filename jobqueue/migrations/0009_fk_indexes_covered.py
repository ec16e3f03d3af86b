"""Three foreign keys lose the index Django gives each: an index that leads with
the same column covers every lookup by it (attempt (job, number), attempt
(worker, state), jobevent (job, id)), and each index is one more write per
claim, finish or event. Dropped by name (DROP INDEX, on both backends), since
on SQLite AlterField would copy the whole table to drop an index."""

import django.db.models.deletion
from django.db import migrations, models

DROPPED = ["queue_attempt_job_id_16e458ae", "queue_attempt_worker_id_513ec850", "queue_jobevent_job_id_841572be"]
RESTORED = [
    'CREATE INDEX "queue_attempt_job_id_16e458ae" ON "queue_attempt" ("job_id")',
    'CREATE INDEX "queue_attempt_worker_id_513ec850" ON "queue_attempt" ("worker_id")',
    'CREATE INDEX "queue_jobevent_job_id_841572be" ON "queue_jobevent" ("job_id")',
]


class Migration(migrations.Migration):
    dependencies = [("queue", "0008_retry_forget_audit")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(f'DROP INDEX IF EXISTS "{name}"', reverse_sql=restore)
                for name, restore in zip(DROPPED, RESTORED, strict=True)
            ],
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
