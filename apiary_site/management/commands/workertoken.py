"""`apiary worker token create|revoke|list`: per-worker credentials, on the control plane.

    create ID              issue a credential for ID (shown once); earlier ones stay valid
    revoke ID [--previous] revoke all of ID's credentials (its jobs go back to the queue and
                           it cannot enrol again until `create`), or with --previous all but
                           the newest: the end of a rotation
    list                   every credential: worker, hint, issued by, created, last used, revoked
"""

from django.core.management.base import CommandError

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import cli_actor, queue_database
from jobqueue import services
from jobqueue.exceptions import NotFound, ReservedWorkerId
from jobqueue.models import WorkerCredential
from jobqueue.types import WORKER_ID_HINT, WORKER_ID_RE


def _worker_id(text: str) -> str:
    if not WORKER_ID_RE.fullmatch(text):
        raise CommandError(f"worker id {text[:80]!r}: expected {WORKER_ID_HINT}", returncode=2)
    return text


class Command(ApiaryCommand):
    words = "worker token"
    help = "Issue, revoke and list per-worker credentials (README: Security)."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=("create", "revoke", "list"), help="create ID, revoke ID [--previous], list")
        parser.add_argument("worker_id", nargs="?", help="the worker id (create, revoke)")
        parser.add_argument(
            "--previous", action="store_true", help="revoke: keep the newest credential (end a rotation's overlap)"
        )
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        action, worker_id = options["action"], options["worker_id"]
        if (action == "list") != (worker_id is None):
            raise CommandError("usage: apiary worker token create ID | revoke ID [--previous] | list", returncode=2)
        # Works before the first `apiary run` (firstrun.ensure_database): issuing the fleet's
        # credentials is part of setting up, before any control plane has started.
        firstrun.ensure_database(options["config"])
        with queue_database():
            if action == "create":
                self._create(_worker_id(worker_id))
            elif action == "revoke":
                self._revoke(_worker_id(worker_id), options["previous"])
            else:
                self._list()

    def _create(self, worker_id: str) -> None:
        try:
            _, secret = services.credential_issue(worker_id=worker_id)
        except ReservedWorkerId as exc:
            raise CommandError(exc.message, returncode=2) from exc
        self.stderr.write(
            f"credential for worker {worker_id} (shown once; give it to the worker as --token-file or "
            "$APIARY_WORKER_TOKEN, then revoke the old one with `apiary worker token revoke "
            f"{worker_id} --previous`):"
        )
        self.stdout.write(secret)

    def _revoke(self, worker_id: str, previous: bool) -> None:
        try:
            revoked = services.credentials_revoke(worker_id=worker_id, keep_newest=previous, actor=cli_actor())
        except NotFound as exc:
            raise CommandError(exc.message) from exc
        hints = ", ".join(f"{c.hint}…" for c in revoked)
        if previous:
            self.stdout.write(f"worker {worker_id}: revoked {len(revoked)} older credential(s) ({hints})")
        else:
            self.stdout.write(
                f"worker {worker_id}: revoked {len(revoked)} credential(s) ({hints}); its jobs went back to the "
                f"queue and it cannot enrol again until `apiary worker token create {worker_id}`"
            )

    def _list(self) -> None:
        rows = WorkerCredential.objects.order_by("worker_id", "created_at")
        if not rows:
            self.stdout.write("no worker credentials")
            return
        self.stdout.write(f"{'worker':<24} {'credential':<12} {'issued by':<10} {'created':<20} {'last used':<20} revoked")
        for c in rows:
            self.stdout.write(
                f"{c.worker_id:<24} {c.hint + '…':<12} {c.issued_by:<10} {c.created_at:%Y-%m-%d %H:%M:%S}  "
                f"{(f'{c.last_used_at:%Y-%m-%d %H:%M:%S}' if c.last_used_at else '-'):<20} "
                f"{f'{c.revoked_at:%Y-%m-%d %H:%M:%S}' if c.revoked_at else '-'}"
            )
