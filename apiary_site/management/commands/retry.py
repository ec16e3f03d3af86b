"""`apiary retry INSTANCE`: queue a failed or cancelled workflow instance's job again (services.job_retry)."""

from django.core.management.base import CommandError

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import cli_actor, instance_arguments, instance_with_job, queue_database
from jobqueue import services
from jobqueue.exceptions import InvalidRequest, NotFound


class Command(ApiaryCommand):
    words = "retry"
    help = (
        "Retry a failed or cancelled workflow instance: its job is queued again as a new attempt "
        "(a publish or spawn its journal records done is not run again)."
    )

    def add_arguments(self, parser):
        instance_arguments(parser)

    def handle(self, *args, **options):
        instance_id = options["instance"]
        # No database yet: one line (firstrun.require_database). An instance exists only once `apiary run` ran.
        firstrun.require_database()
        with queue_database():
            instance = instance_with_job(instance_id)
            before = instance.job.state
            try:
                job = services.job_retry(job_id=instance.job.pk, actor=cli_actor())
            except InvalidRequest as exc:
                raise CommandError(f"instance {instance_id}: {exc.message}") from exc
            except NotFound as exc:
                raise CommandError(f"no workflow instance {instance_id}: {exc.message}") from exc
        self.stdout.write(
            f"instance {instance_id} (job {job.pk}) was {before}; queued again, "
            f"its next run is attempt {job.attempt_count + 1}"
        )
