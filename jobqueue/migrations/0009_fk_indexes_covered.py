"""Three foreign keys lose the index Django gives each (jobqueue/covered_indexes.py): an
index that leads with the same column covers every lookup by it (attempt (job, number),
attempt (worker, state), jobevent (job, id)), and each index is one more write per
claim, finish or event; on PostgreSQL with the varchar_pattern_ops twin Django made for
attempt.worker (a text key)."""

import django.db.models.deletion
from django.db import migrations, models

from jobqueue.covered_indexes import dropping


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0008_retry_forget_audit")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                dropping([
                    ("queue_attempt_job_id_16e458ae", 'ON "queue_attempt" ("job_id")'),
                    ("queue_attempt_worker_id_513ec850", 'ON "queue_attempt" ("worker_id")'),
                    ("queue_jobevent_job_id_841572be", 'ON "queue_jobevent" ("job_id")'),
                    ("queue_attempt_worker_id_513ec850_like", 'ON "queue_attempt" ("worker_id" varchar_pattern_ops)'),
                ])
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
