"""`apiary backup PATH`: a consistent copy of the control plane's SQLite database."""

from pathlib import Path

from django.core.management.base import CommandError
from django.db import connection

from apiary_site import bootstrap, sqlitefiles
from apiary_site.management.base import ApiaryCommand

POSTGRES = (
    "on PostgreSQL, backups are pg_dump's job: pg_dump --format=custom \"$DATABASE_URL\" > apiary.dump "
    "(and pg_restore to restore); apiary backup and restore copy the SQLite database only"
)


class Command(ApiaryCommand):
    words = "backup"
    help = "Write a consistent copy of the SQLite database to PATH (online: the daemon may keep running)."

    def add_arguments(self, parser):
        parser.add_argument("path", metavar="PATH", help="the copy to write (refused if it exists)")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        bootstrap.configure_if_present(options["config"])
        if connection.vendor != "sqlite":
            raise CommandError(POSTGRES)
        target = Path(options["path"]).resolve()
        if target.exists():
            raise CommandError(f"{target} exists; refusing to overwrite it")
        target.parent.mkdir(parents=True, exist_ok=True)
        source = Path(connection.settings_dict["NAME"])
        if not source.is_file():
            raise CommandError(f"no database at {source}; has `apiary run` run here?")
        try:
            sqlitefiles.snapshot(source, target)
        except (sqlitefiles.CopyError, OSError) as exc:
            raise CommandError(f"backup failed, nothing written to {target}: {exc}") from exc
        self.stdout.write(f"backup written to {target} (mode 0600, integrity_check ok)")
