"""`apiary cancel INSTANCE`: cancel a workflow instance's job through the queue service."""

from django.core.management.base import CommandError

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import cli_actor, instance_arguments, instance_with_job, queue_database
from jobqueue import services
from jobqueue.exceptions import NotFound
from jobqueue.models import TERMINAL_JOB_STATES, JobState


class Command(ApiaryCommand):
    words = "cancel"
    help = "Cancel a workflow instance: at once when queued, at the worker's next heartbeat when running."

    def add_arguments(self, parser):
        instance_arguments(parser)

    def handle(self, *args, **options):
        instance_id = options["instance"]
        # No database yet: one line (firstrun.require_database). An instance exists only once `apiary run` ran.
        firstrun.require_database()
        with queue_database():
            instance = instance_with_job(instance_id)
            before = instance.job
            try:
                job = services.job_cancel(job_id=before.pk, actor=cli_actor())
            except NotFound as exc:
                raise CommandError(f"no workflow instance {instance_id}: {exc.message}") from exc
        what = f"instance {instance_id} (job {job.pk})"
        if before.state in TERMINAL_JOB_STATES:
            self.stdout.write(f"{what} already {before.state}; nothing to cancel")
        elif job.state == JobState.CANCELLED:
            self.stdout.write(f"{what} cancelled")
        elif before.cancel_requested_at is not None:
            self.stdout.write(f"{what}: cancel was already requested; waiting for the worker")
        else:
            self.stdout.write(f"{what}: cancel requested; the worker stops it at its next heartbeat")
