"""The job's class (requirements) loses the index Django gives its foreign key
(jobqueue/covered_indexes.py): every look-up of jobs by class is of queued ones (the claim's
walk, the blocked-jobs view), which the partial job_claim_order (requirements, priority,
available_at, id) WHERE state = 'queued' serves, and a class is never deleted (PROTECT, and
no service or admin deletes one). One index page fewer per enqueue."""

import django.db.models.deletion
from django.db import migrations, models

from jobqueue.covered_indexes import dropping


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0010_more_fk_indexes_covered")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[dropping([("queue_job_requirements_id_baff8aa7", 'ON "queue_job" ("requirements_id")')])],
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="requirements",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.PROTECT, related_name="jobs",
                        to="queue.requirementset",
                    ),
                ),
            ],
        )
    ]
