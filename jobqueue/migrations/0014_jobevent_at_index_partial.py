"""An event's time is indexed only for the events that settle a job (jobqueue/covered_indexes.py):
the dashboard's outcomes per minute is the one lookup by time, and it asks for those kinds
alone. A job's `enqueued` and `claimed` events, and a cancel request's or a retry's, each wrote
an entry no lookup reads: one index page fewer per enqueue and per claim. The dashboard's query
names the kinds as the index does, in literal text, so SQLite uses the partial index for it
(selectors/dashboard.py). Made before the old one is dropped, CONCURRENTLY on PostgreSQL."""

from django.db import migrations, models

from jobqueue.covered_indexes import replacing


class Migration(migrations.Migration):
    atomic = False  # PostgreSQL's CREATE and DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("queue", "0013_job_current_attempt_unique_partial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                replacing(
                    ("jobevent_at", 'ON "queue_jobevent" ("at")'),
                    (
                        "jobevent_settled_at",
                        """ON "queue_jobevent" ("at") WHERE "kind" IN ('finished', 'expired', 'cancelled')""",
                    ),
                )
            ],
            state_operations=[
                migrations.RemoveIndex(model_name="jobevent", name="jobevent_at"),
                migrations.AddIndex(
                    model_name="jobevent",
                    index=models.Index(
                        condition=models.Q(("kind__in", ("finished", "expired", "cancelled"))),
                        fields=["at"],
                        name="jobevent_settled_at",
                    ),
                ),
            ],
        )
    ]
