"""A new SQLite database built from the schema snapshot (apiary_site/fresh_schema.json) is
the database the migrations build: the same tables, indexes and triggers to the letter,
the same rows in every table (content types, permissions, AUTOINCREMENT counters), the
same migrations recorded, nothing left to apply, so `migrate` is not run after it; the
snapshot committed is the one the migrations build today; a snapshot older than the tree
is completed by `migrate`, which applies only what it lacks; without the snapshot file a new
database is migrated from nothing; a database with tables is never touched.

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
def plan():
    executor = MigrationExecutor(connection)
    return [f"{m.app_label}.{m.name}" for m, _ in executor.migration_plan(executor.loader.graph.leaf_nodes())]

complete = left = None
if how == "migrate":
    call_command("migrate", interactive=False, verbosity=0)
elif how == "snapshot":  # as `apiary run` prepares a new project's database
    from apiary_site import bootstrap
    from workflows.config import load
    Path("apiary.yaml").write_text("project: fresh\n")
    migrating = bootstrap.call_command
    ran = []  # what each migrate that bootstrap runs after the snapshot has left to apply
    bootstrap.call_command = lambda *args, **kwargs: (ran.append(plan()), migrating(*args, **kwargs))
    bootstrap.prepare_database(load("apiary.yaml"))
    complete, left = not ran, (ran[0] if ran else [])
elif how == "all-but-last":  # the tree as it was before its newest workflows migration
    executor = MigrationExecutor(connection)
    (last,) = [node for node in executor.loader.graph.leaf_nodes() if node[0] == "workflows"]
    targets = [node for node in executor.loader.graph.leaf_nodes() if node != last]
    targets.append(executor.loader.graph.node_map[last].parents.copy().pop().key)
    executor.migrate(targets)
    Path(sys.argv[3]).write_text(json.dumps(fresh_schema.dump(connection)))
    print(json.dumps({"left_out": f"{last[0]}.{last[1]}"}))
    sys.exit(0)

with connection.cursor() as cursor:
    cursor.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")
    master = [list(row) for row in cursor.fetchall()]
    tables = {}
    for kind, name, _, _ in master:
        if kind == "table" and name != "django_migrations":
            # A counter at 0 is one never used: the next id is 1 with it or without it.
            cursor.execute(f'SELECT * FROM "{name}"' + (" WHERE seq > 0" if name == "sqlite_sequence" else ""))
            tables[name] = sorted(repr(row) for row in cursor.fetchall())
    cursor.execute('SELECT "app", "name" FROM "django_migrations"')
    migrations = sorted(list(row) for row in cursor.fetchall())
    cursor.execute('SELECT "app_label", "model" FROM "django_content_type"')
    types = sorted(list(row) for row in cursor.fetchall())
    cursor.execute(  # by name: the ids follow the order post-migrate made them in
        'SELECT p."codename", t."app_label", t."model" FROM "auth_permission" p JOIN "django_content_type" t ON t."id" = p."content_type_id"'
    )
    permissions = sorted(list(row) for row in cursor.fetchall())
print(json.dumps({
    "complete": complete, "left": left, "master": master, "tables": tables, "migrations": migrations,
    "types": types, "permissions": permissions, "pending": plan(), "dump": fresh_schema.dump(connection),
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
    return json.loads(done.stdout.splitlines()[-1])


BY_ID = ("django_content_type", "auth_permission", "sqlite_sequence")  # rows whose ids follow post-migrate's order


def same_database(a: dict, b: dict, *, exact: bool = True) -> None:
    """The same schema, migrations, content types and permissions; the same rows in every
    table (`exact=False`: but the ids of those that post-migrate numbered in its own order)."""
    for key in ("master", "migrations", "types", "permissions"):
        assert a[key] == b[key], key
    assert a["tables"].keys() == b["tables"].keys()
    for table in a["tables"]:
        if exact or table not in BY_ID:
            assert a["tables"][table] == b["tables"][table], table


def test_the_committed_snapshot_is_what_the_migrations_build(tmp_path):
    migrated = child("migrate", tmp_path / "migrated.db")
    committed = json.loads((REPO / "apiary_site" / "fresh_schema.json").read_text())
    assert committed == migrated["dump"], f"apiary_site/fresh_schema.json is stale: run {REGENERATE}"


def test_a_new_database_from_the_snapshot_is_the_migrated_one(tmp_path):
    migrated = child("migrate", tmp_path / "migrated.db")
    snapped = child("snapshot", tmp_path / "snapped.db")
    assert snapped["complete"] is True and snapped["left"] == []  # so bootstrap runs no migrate after it
    assert snapped["pending"] == migrated["pending"] == []
    assert any(row[1] == "queue_job" for row in snapped["master"])
    assert len(snapped["types"]) > 20 and len(snapped["permissions"]) > 80  # post-migrate's rows, as it made them
    same_database(snapped, migrated)


def test_a_snapshot_older_than_the_tree_is_completed_by_migrate(tmp_path):
    older = tmp_path / "older.json"
    left_out = child("all-but-last", tmp_path / "older.db", str(older))["left_out"]
    assert json.loads(older.read_text())["migrations"] != json.loads((REPO / "apiary_site" / "fresh_schema.json").read_text())["migrations"]
    migrated = child("migrate", tmp_path / "migrated.db")
    snapped = child("snapshot", tmp_path / "snapped.db", snapshot=older)
    assert snapped["complete"] is False and snapped["left"] == [left_out]
    assert snapped["pending"] == []
    same_database(snapped, migrated, exact=False)


def test_a_database_with_tables_is_left_alone(tmp_path):
    db = tmp_path / "existing.db"
    first = child("migrate", db)
    again = child("snapshot", db)
    assert again["complete"] is False and again["left"] == []  # migrate ran, and found nothing to do
    same_database(again, first)


def test_without_its_snapshot_file_a_new_database_is_migrated(tmp_path):
    migrated = child("migrate", tmp_path / "migrated.db")
    snapped = child("snapshot", tmp_path / "snapped.db", snapshot=tmp_path / "missing.json")
    assert snapped["complete"] is False and len(snapped["left"]) > 30  # every migration, from nothing
    assert snapped["pending"] == []
    same_database(snapped, migrated, exact=False)
