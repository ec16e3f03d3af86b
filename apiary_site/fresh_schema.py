"""A new SQLite database takes its schema from a snapshot instead of its migrations.

`migrate` on an empty database replays every migration of every installed app
(Django's contrib apps, axes, the queue, the workflows: more than thirty), and
Django renders the models' state again after nearly each one. That costs about
0.9 s of CPU, most of a fresh `apiary run`'s start-up. The schema those
migrations leave behind is fixed for a given tree, so it is kept here, in
fresh_schema.json: the `CREATE` statements read back from `sqlite_master` of
a freshly migrated database, in the order SQLite holds them, and the rows
`django_migrations` holds then.

`load_if_new` runs them on a database with no tables, in one transaction that
takes the write lock first (the settings' IMMEDIATE mode), so a second process
starting on the same new file finds the tables and leaves them alone. The
`migrate` that follows then finds nothing to apply, or, if the snapshot is older
than the tree, applies only the migrations it lacks; its post-migrate handlers
make the content types and permissions, as they would have.
A database that has any table is never touched; PostgreSQL always migrates.

tests/test_fresh_schema.py rebuilds the snapshot from the migrations and fails
when it differs from the one committed. To write it again:

    .venv/bin/python -m apiary_site.fresh_schema
"""

import json
import os
import sys
import tempfile
from pathlib import Path

from django.db import transaction
from django.utils import timezone

SNAPSHOT = Path(__file__).with_name("fresh_schema.json")


def load_if_new(connection) -> bool:
    """Build a database with no tables from the snapshot; False (nothing done) when it has any."""
    snapshot = json.loads(SNAPSHOT.read_text())
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        if connection.introspection.table_names(cursor):
            return False
        for statement in snapshot["schema"]:
            cursor.execute(statement)  # no parameters: the text is run as it is
        now = timezone.now()
        cursor.executemany(
            'INSERT INTO "django_migrations" ("app", "name", "applied") VALUES (%s, %s, %s)',
            [(app, name, now) for app, name in snapshot["migrations"]],
        )
    return True


def dump(connection) -> dict:
    """The snapshot of a migrated database: its CREATE statements and its applied migrations."""
    with connection.cursor() as cursor:
        # rowid order is creation order: a table before its indexes and before the tables referring to it.
        cursor.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY rowid"
        )
        schema = [sql for (sql,) in cursor.fetchall()]
        cursor.execute('SELECT "app", "name" FROM "django_migrations" ORDER BY "id"')
        migrations = [list(row) for row in cursor.fetchall()]
    return {"schema": schema, "migrations": migrations}


def _write() -> None:
    """Migrate a new database in a temporary directory and write its snapshot over SNAPSHOT."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.pop("DATABASE_URL", None)
        os.environ["APIARY_DB_PATH"] = str(Path(tmp) / "snapshot.db")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", interactive=False, verbosity=0)  # the migrations themselves: no snapshot here
        SNAPSHOT.write_text(json.dumps(dump(connection), indent=1) + "\n")
        connection.close()
    print(f"wrote {SNAPSHOT}", file=sys.stderr)


if __name__ == "__main__":
    _write()
