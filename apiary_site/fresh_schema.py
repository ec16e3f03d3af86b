"""A new SQLite database is built from a snapshot of a migrated one, not by its migrations.

`migrate` on an empty database replays every migration of every installed app
(Django's contrib apps, axes, the queue, the workflows: more than forty), and
Django renders the models' state again after nearly each one; then its
post-migrate handlers add the content types and permissions. That costs about
1 s of CPU, most of a fresh `apiary run`'s start-up. What they leave behind is
fixed for a given tree, so it is kept in fresh_schema.json: the `CREATE`
statements read back from `sqlite_master` of a freshly migrated database, in
the order SQLite holds them, the rows of its tables, and the migrations
`django_migrations` lists then.

`build_if_new` runs them on a database with no tables, in one transaction that
takes the write lock first (the settings' IMMEDIATE mode), so a second process
starting on the same new file finds the tables and leaves them alone. When the
snapshot lists every migration on disk, the database is then the migrated one
and there is nothing for `migrate` to do; when the tree has a migration the
snapshot lacks, `migrate` runs after it and applies only what is missing (and
its post-migrate handlers add what the new models need). A database that has
any table is never touched; PostgreSQL always migrates.

tests/test_fresh_schema.py rebuilds the snapshot from the migrations and fails
when it differs from the one committed. To write it again:

    .venv/bin/python -m apiary_site.fresh_schema
"""

import importlib
import json
import os
import pkgutil
import sys
import tempfile
from pathlib import Path

from django.apps import apps
from django.db import transaction
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

SNAPSHOT = Path(__file__).with_name("fresh_schema.json")


def build_if_new(connection) -> bool:
    """Build a database with no tables from the snapshot. True when that made the whole schema
    (every migration on disk is the snapshot's); False when there were tables (nothing done), when
    the snapshot file is missing (a tree installed without its package data: `migrate` builds it
    all), or when the tree has migrations the snapshot lacks (`migrate` must follow)."""
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        if connection.introspection.table_names(cursor):
            return False
        try:
            snapshot = json.loads(SNAPSHOT.read_text())
        except FileNotFoundError:
            return False
        for statement in snapshot["schema"]:
            cursor.execute(statement)  # no parameters: the text is run as it is
        for table, (columns, rows) in snapshot["rows"].items():
            names = ", ".join(connection.ops.quote_name(column) for column in columns)
            marks = ", ".join(["%s"] * len(columns))
            cursor.executemany(f"INSERT INTO {connection.ops.quote_name(table)} ({names}) VALUES ({marks})", rows)
        applied = connection.ops.adapt_datetimefield_value(timezone.now())  # as the migration recorder writes it
        cursor.executemany(
            'INSERT INTO "django_migrations" ("app", "name", "applied") VALUES (%s, %s, %s)',
            [(app, name, applied) for app, name in snapshot["migrations"]],
        )
    return on_disk() <= {(app, name) for app, name in snapshot["migrations"]}


def on_disk() -> set[tuple[str, str]]:
    """(app label, migration name) of every migration file of the installed apps, found as
    Django's loader finds them (MigrationLoader.load_disk) but without importing them."""
    found = set()
    for config in apps.get_app_configs():
        module_name, _ = MigrationLoader.migrations_module(config.label)
        if module_name is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # an app without migrations
            continue
        if getattr(module, "__file__", None) is None or not isinstance(getattr(module, "__path__", None), list):
            continue  # not a package, or a namespace one: Django's loader skips those too
        found |= {
            (config.label, name) for _, name, is_pkg in pkgutil.iter_modules(module.__path__) if not is_pkg and name[0] not in "_~"
        }
    return found


def dump(connection) -> dict:
    """The snapshot of a migrated database: its CREATE statements, its rows, its applied migrations."""
    with connection.cursor() as cursor:
        # rowid order is creation order: a table before its indexes and before the tables referring to it.
        cursor.execute(
            "SELECT type, name, sql FROM sqlite_master"
            " WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY rowid"
        )
        objects = cursor.fetchall()
        rows = {}
        for kind, table, _ in objects:
            if kind != "table" or table == "django_migrations":
                continue
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)} ORDER BY rowid")
            found = cursor.fetchall()
            if found:
                rows[table] = [[column[0] for column in cursor.description], [list(row) for row in found]]
        cursor.execute('SELECT "app", "name" FROM "django_migrations" ORDER BY "id"')
        migrations = [list(row) for row in cursor.fetchall()]
    return {"schema": [sql for _, _, sql in objects], "rows": rows, "migrations": migrations}


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
