"""`apiary backup PATH`: a consistent copy of the control plane's SQLite database."""

import sqlite3
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import connection


class Command(BaseCommand):
    help = "Write a consistent copy of the SQLite database to PATH (online: the daemon may keep running)."

    def add_arguments(self, parser):
        parser.add_argument("path")
        parser.add_argument("--config")

    def handle(self, *args, **options):
        if connection.vendor != "sqlite":
            raise CommandError("apiary backup copies the SQLite database; on PostgreSQL use pg_dump")
        target = Path(options["path"]).resolve()
        if target.exists():
            raise CommandError(f"{target} exists; refusing to overwrite it")
        target.parent.mkdir(parents=True, exist_ok=True)
        source = sqlite3.connect(connection.settings_dict["NAME"])
        copy = sqlite3.connect(target)
        try:
            # SQLite's online backup API: a page-by-page copy that is consistent
            # even while the daemon writes (it restarts if a page changes).
            source.backup(copy)
        finally:
            copy.close()
            source.close()
        self.stdout.write(f"backup written to {target}")
