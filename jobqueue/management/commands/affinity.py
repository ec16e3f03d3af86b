"""`apiary affinity release TASK`: unpin a task so any eligible worker may take its jobs."""

from django.core.management.base import BaseCommand, CommandError

from jobqueue import services
from jobqueue.selectors import task_exists, task_pin


class Command(BaseCommand):
    help = "Release a task's affinity pin."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["release"], help="what to do with the pin")
        parser.add_argument("task", type=int, help="task id")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (read by the apiary entry point)")

    def handle(self, *args, **options):
        task_id = options["task"]
        if not task_exists(task_id=task_id):
            raise CommandError(f"no task {task_id}")
        pinned_to = task_pin(task_id=task_id)
        if services.affinity_release(task_id=task_id):
            self.stdout.write(f"task {task_id}: released its pin to worker {pinned_to}")
        else:
            self.stdout.write(f"task {task_id} was not pinned")
