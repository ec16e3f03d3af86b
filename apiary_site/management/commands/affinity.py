"""`apiary affinity release TASK`: unpin a task so any eligible worker may take its jobs."""

from django.core.management.base import CommandError

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import cli_actor, positive_id, queue_database
from jobqueue import selectors, services
from workflows.models import Task
from workflows.services import affinity_key


class Command(ApiaryCommand):
    words = "affinity"
    help = "Release a task's affinity pin."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["release"], help="what to do with the pin")
        parser.add_argument("task", type=positive_id, help="task id")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (read by the apiary entry point)")

    def handle(self, *args, **options):
        task_id = options["task"]
        # No database yet: one line (firstrun.require_database). A pin exists only once a worker claimed a job.
        firstrun.require_database()
        with queue_database():
            if not Task.objects.filter(pk=task_id).exists():
                raise CommandError(f"no task {task_id}")
            key = affinity_key(task_id)
            pinned_to = selectors.affinity_pin(key=key)
            released = services.affinity_release(key=key, actor=cli_actor())
        if released:
            self.stdout.write(f"task {task_id}: released its pin to worker {pinned_to}")
        else:
            self.stdout.write(f"task {task_id} was not pinned")
