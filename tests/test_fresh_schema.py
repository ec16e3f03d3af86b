"""A new SQLite database built from the schema snapshot (apiary_site/fresh_schema.json) is
the database the migrations build: the same tables, indexes and triggers to the letter,
the same migrations recorded, the same content types and permissions, nothing left to
apply; the snapshot committed is the one the migrations build today; a snapshot older
than the tree is completed by `migrate`; a database with tables is never touched.

Each database is built in a child process on a new SQLite file, as `apiary run` builds it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python -m apiary_site.fresh_schema"

CHILD = r"""
import json, sys
from pathlib import Path
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from apiary_site import fresh_schema

how, snapshot = sys.argv[1], sys.argv[2]
if snapshot:
    fresh_schema.SNAPSHOT = Path(snapshot)
loaded = None
if how == "migrate":
    call_command("migrate", interactive=False, verbosity=0)
elif how == "snapshot":  # what bootstrap.prepare_database does
    loaded = fresh_schema.load_if_new(connection)
    call_command("migrate", interactive=False, verbosity=0)
elif how == "all-but-last":  # the tree as it was before its newest workflows migration
    executor = MigrationExecutor(connection)
    (last,) = [node for node in executor.loader.graph.leaf_nodes() if node[0] == "workflows"]
    targets = [node for node in executor.loader.graph.leaf_nodes() if node != last]
    targets.append(executor.loader.graph.node_map[last].parents.copy().pop().key)
    executor.migrate(targets)
    Path(sys.argv[3]).write_text(json.dumps(fresh_schema.dump(connection)))
    sys.exit(0)

with connection.cursor() as cursor:
    cursor.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")
    master = [list(row) for row in cursor.fetchall()]
    cursor.execute('SELECT "app", "name" FROM "django_migrations"')
    migrations = sorted(list(row) for row in cursor.fetchall())
    cursor.execute('SELECT "app_label", "model" FROM "django_content_type"')
    types = sorted(list(row) for row in cursor.fetchall())
    cursor.execute(  # by name: the ids follow the order post-migrate made them in
        'SELECT p."codename", t."app_label", t."model" FROM "auth_permission" p JOIN "django_content_type" t ON t."id" = p."content_type_id"'
    )
    permissions = sorted(list(row) for row in cursor.fetchall())
later = MigrationExecutor(connection)
pending = [f"{m.app_label}.{m.name}" for m, _ in later.migration_plan(later.loader.graph.leaf_nodes())]
print(json.dumps({
    "loaded": loaded, "master": master, "migrations": migrations, "types": types,
    "permissions": permissions, "pending": pending, "dump": fresh_schema.dump(connection),
}))
"""


def child(how: str, db: Path, *extra: str, snapshot: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"}
    env.update(DJANGO_SETTINGS_MODULE="apiary_site.settings", APIARY_DB_PATH=str(db), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(snapshot or ""), *extra],
        cwd=db.parent, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]) if done.stdout.strip() else {}


def same_database(a: dict, b: dict) -> None:
    for key in ("master", "migrations", "types", "permissions"):
        assert a[key] == b[key], key


def test_the_committed_snapshot_is_what_the_migrations_build(tmp_path):
    migrated = child("migrate", tmp_path / "migrated.db")
    committed = json.loads((REPO / "apiary_site" / "fresh_schema.json").read_text())
    assert committed == migrated["dump"], f"apiary_site/fresh_schema.json is stale: run {REGENERATE}"


def test_a_new_database_from_the_snapshot_is_the_migrated_one(tmp_path):
    migrated = child("migrate", tmp_path / "migrated.db")
    snapped = child("snapshot", tmp_path / "snapped.db")
    assert snapped["loaded"] is True
    assert snapped["pending"] == migrated["pending"] == []
    assert any(row[1] == "queue_job" for row in snapped["master"])
    assert len(snapped["types"]) > 20 and len(snapped["permissions"]) > 80  # post-migrate's rows, made as before
    same_database(snapped, migrated)


def test_a_snapshot_older_than_the_tree_is_completed_by_migrate(tmp_path):
    older = tmp_path / "older.json"
    child("all-but-last", tmp_path / "older.db", str(older))
    assert json.loads(older.read_text())["migrations"] != json.loads((REPO / "apiary_site" / "fresh_schema.json").read_text())["migrations"]
    migrated = child("migrate", tmp_path / "migrated.db")
    snapped = child("snapshot", tmp_path / "snapped.db", snapshot=older)
    assert snapped["loaded"] is True and snapped["pending"] == []
    same_database(snapped, migrated)


def test_a_database_with_tables_is_left_alone(tmp_path):
    db = tmp_path / "existing.db"
    first = child("migrate", db)
    again = child("snapshot", db)
    assert again["loaded"] is False
    same_database(again, first)
