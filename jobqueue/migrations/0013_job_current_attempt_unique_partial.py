"""A job's current attempt stays unique, but only where it is set: as a one-to-one it had an
index entry for every job, NULL included, and every enqueue wrote one that no lookup reads
(a queued job has no attempt, nor has a finished one whose attempt was re-queued). Now a
partial unique index: one index page fewer per enqueue.

On SQLite the column's UNIQUE is part of the table's definition, so Django copies the table
to drop it (once, in this migration's transaction); on PostgreSQL the constraint is dropped
and the partial index built in the same transaction, which holds queue_job's writes until it
is built (it reads only the jobs that have an attempt, but scans them all)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("queue", "0012_jobevent_attempt_index_partial")]

    operations = [
        migrations.AlterField(
            model_name="job",
            name="current_attempt",
            field=models.ForeignKey(
                blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.SET_NULL,
                related_name="+", to="queue.attempt",
            ),
        ),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.UniqueConstraint(
                condition=models.Q(("current_attempt__isnull", False)), fields=("current_attempt",),
                name="job_current_attempt_unique",
            ),
        ),
    ]
