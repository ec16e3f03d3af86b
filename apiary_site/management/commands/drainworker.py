"""`apiary worker drain ID [--undo]`: ask a worker to stop claiming, finish its jobs and exit."""

from django.core.management.base import BaseCommand, CommandError

from apiary_site.management.inputs import cli_actor, queue_database
from jobqueue import services
from jobqueue.exceptions import NotFound


class Command(BaseCommand):
    help = "Ask a worker to drain (it learns on its next heartbeat); --undo withdraws the request."

    def add_arguments(self, parser):
        parser.add_argument("worker_id", help="worker id")
        parser.add_argument("--undo", action="store_true", help="withdraw the drain request")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (read by the apiary entry point)")

    def handle(self, *args, **options):
        worker_id = options["worker_id"]
        call = services.worker_undrain if options["undo"] else services.worker_drain
        try:
            with queue_database():
                call(worker_id=worker_id, actor=cli_actor())
        except NotFound as exc:
            raise CommandError(f"no worker {worker_id!r}") from exc
        if options["undo"]:
            self.stdout.write(f"worker {worker_id}: drain request withdrawn")
        else:
            self.stdout.write(f"worker {worker_id}: drain requested; it stops claiming at its next heartbeat")
