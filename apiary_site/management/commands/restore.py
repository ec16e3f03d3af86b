"""`apiary restore PATH`: replace the SQLite queue database with a backup, while no daemon runs."""

from pathlib import Path

from django.core.management.base import CommandError
from django.db import connection

from apiary_site import bootstrap, sqlitefiles
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.commands.backup import POSTGRES
from apiary_site.statelock import StateLock, StateLocked


class Command(ApiaryCommand):
    words = "restore"
    help = "Replace the SQLite database with the backup at PATH (checked first); refused while `apiary run` runs."

    def add_arguments(self, parser):
        parser.add_argument("path", metavar="PATH", help="a backup written by `apiary backup` (checked before use)")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        config = bootstrap.configure(options["config"])
        if connection.vendor != "sqlite":
            raise CommandError(POSTGRES)
        backup = Path(options["path"]).resolve()
        problem = sqlitefiles.problem_with(backup)
        if problem:
            raise CommandError(f"{backup}: {problem}; nothing restored", returncode=2)
        try:  # held throughout: no daemon may start on a database being replaced
            lock = StateLock.acquire(config.state_dir, purpose="apiary restore")
        except StateLocked as exc:
            raise CommandError(f"refusing to restore: {exc}") from exc
        try:
            database = Path(connection.settings_dict["NAME"])
            connection.close()
            bootstrap.secure_state(config)  # creates an empty database file if there was none: replaced below
            kept = sqlitefiles.replace(database, backup)
        except (sqlitefiles.CopyError, OSError) as exc:
            raise CommandError(f"restore failed, the database is unchanged: {exc}") from exc
        finally:
            lock.release()
        self.stdout.write(f"restored {backup} into {database} (mode 0600)")
        if kept:
            self.stdout.write(f"the previous database is kept at {kept}")
