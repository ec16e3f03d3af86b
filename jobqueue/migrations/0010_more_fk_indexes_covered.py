"""Three more foreign keys lose the index Django gives each (jobqueue/covered_indexes.py):
jobrecord (job, key), logstream (attempt, name) and logstream (job, id) lead with them.
Every job writes a record and a log stream: two index pages fewer per job, three per stream."""

import django.db.models.deletion
from django.db import migrations, models

from jobqueue.covered_indexes import dropping


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0009_fk_indexes_covered")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                dropping([
                    ("queue_jobrecord_job_id_910c0ed9", 'ON "queue_jobrecord" ("job_id")'),
                    ("queue_logstream_attempt_id_fa0133c2", 'ON "queue_logstream" ("attempt_id")'),
                    ("queue_logstream_job_id_c4a921b5", 'ON "queue_logstream" ("job_id")'),
                ])
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="jobrecord",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="records", to="queue.job"
                    ),
                ),
                migrations.AlterField(
                    model_name="logstream",
                    name="attempt",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="log_streams",
                        to="queue.attempt",
                    ),
                ),
                migrations.AlterField(
                    model_name="logstream",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="+", to="queue.job"
                    ),
                ),
            ],
        )
    ]
