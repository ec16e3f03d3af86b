"""`apiary worker drain ID [--undo]`: ask a worker to stop claiming, finish its jobs and exit.
`apiary worker undrain ID` (undrainworker) is the same command with --undo."""

from django.core.management.base import CommandError

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import cli_actor, queue_database
from jobqueue import services
from jobqueue.exceptions import NotFound


class Command(ApiaryCommand):
    words = "worker drain"
    help = "Ask a worker to drain: it stops claiming at its next heartbeat, finishes its jobs and exits."
    undo = False  # undrainworker: always withdraws

    def add_arguments(self, parser):
        parser.add_argument("worker_id", metavar="ID", help="worker id (as `apiary status` lists it)")
        if not self.undo:
            parser.add_argument("--undo", action="store_true", help="withdraw the request (apiary worker undrain ID)")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        worker_id = options["worker_id"]
        undo = self.undo or options.get("undo", False)
        call = services.worker_undrain if undo else services.worker_drain
        # No database yet: one line (firstrun.require_database). A worker is known only once it registered.
        firstrun.require_database()
        try:
            with queue_database():
                call(worker_id=worker_id, actor=cli_actor())
        except NotFound as exc:
            raise CommandError(f"no worker {worker_id!r}") from exc
        if undo:
            self.stdout.write(f"worker {worker_id}: drain request withdrawn")
        else:
            self.stdout.write(f"worker {worker_id}: drain requested; it stops claiming at its next heartbeat")
