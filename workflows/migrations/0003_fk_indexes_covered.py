"""Two foreign keys lose the index Django gives each (jobqueue/covered_indexes.py): the unique
steprun (instance, attempt_number, step_id) and instance (task, generation, workflow) lead
with them. Every job writes a step run and every dispatch an instance: an index page fewer each."""

import django.db.models.deletion
from django.db import migrations, models

from jobqueue.covered_indexes import dropping


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("workflows", "0002_spawn")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                dropping([
                    ("workflows_steprun_instance_id_3fef7275", 'ON "workflows_steprun" ("instance_id")'),
                    ("workflows_workflowinstance_task_id_07779884", 'ON "workflows_workflowinstance" ("task_id")'),
                ])
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="steprun",
                    name="instance",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="steps",
                        to="workflows.workflowinstance",
                    ),
                ),
                migrations.AlterField(
                    model_name="workflowinstance",
                    name="task",
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name="instances",
                        to="workflows.task",
                    ),
                ),
            ],
        )
    ]
