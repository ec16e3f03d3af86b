"""The squashed queue migration (0001_squashed_0009) builds the schema that the nine it
replaces build: the same tables, columns, indexes (with their conditions), constraints and
foreign keys; and a database built by the nine finds nothing to apply afterwards. Each schema is built in a child process on a new SQLite file, one by the
squash (what `migrate` does on a new database) and one by the nine (the loader told not to
replace them), and read back from the database itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
SQUASH = ("queue", "0001_squashed_0009_fk_indexes_covered")
AFTER = ["queue.0010_more_fk_indexes_covered", "queue.0011_job_requirements_index_covered", "queue.0012_jobevent_attempt_index_partial", "queue.0013_job_current_attempt_unique_partial", "queue.0014_jobevent_at_index_partial"]  # the queue's migrations after the nine, which both apply

CHILD = r"""
import json, re, sys
import django
django.setup()
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

executor = MigrationExecutor(connection)
if sys.argv[1] == "replaced":
    executor.loader = MigrationLoader(connection, replace_migrations=False)
graph = executor.loader.graph
targets = [node for node in graph.leaf_nodes() if node != tuple(json.loads(sys.argv[2]))]
applied = [m for m, _ in executor.migration_plan(targets)]
executor.migrate(targets)

def norm(sql):
    return re.sub(r"\s+", " ", sql or "").strip()

schema = {}
with connection.cursor() as cursor:
    tables = [t for t in connection.introspection.table_names(cursor) if t.startswith(("queue_", "workflows_"))]
    for table in tables:
        columns = sorted(
            [c.name, c.type_code, c.null_ok, c.default, c.pk] for c in connection.introspection.get_table_description(cursor, table)
        )
        constraints = sorted(
            [("" if name.startswith(("sqlite_autoindex", "__unnamed")) else name), c["columns"], c["unique"], c["index"],
             c["primary_key"], c["foreign_key"], c["check"]]
            for name, c in connection.introspection.get_constraints(cursor, table).items()
        )
        cursor.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = %s AND sql IS NOT NULL", [table])
        indexes = sorted(norm(row[0]) for row in cursor.fetchall())
        schema[table] = {"columns": columns, "constraints": constraints, "indexes": indexes}
# What a later `apiary run` (the loader as it is) finds left to do on this database.
later = MigrationExecutor(connection)
pending = [f"{m.app_label}.{m.name}" for m, _ in later.migration_plan(later.loader.graph.leaf_nodes())]
print(json.dumps({"applied": [f"{m.app_label}.{m.name}" for m in applied], "schema": schema, "pending": pending}))
"""


def built_by(how: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"}
    env.update(DJANGO_SETTINGS_MODULE="apiary_site.settings", APIARY_DB_PATH=str(tmp_path / f"{how}.db"), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, json.dumps(SQUASH)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_squashed_migration_builds_the_schema_the_nine_it_replaces_build(tmp_path):
    squashed, replaced = built_by("squashed", tmp_path), built_by("replaced", tmp_path)
    queue = lambda built: [m for m in built["applied"] if m.startswith("queue.")]  # noqa: E731
    assert queue(squashed) == ["queue." + SQUASH[1], *AFTER]  # a new database takes the one migration
    assert len(queue(replaced)) == 9 + len(AFTER) and SQUASH[1] not in str(replaced["applied"])
    assert squashed["pending"] == replaced["pending"] == []  # a database built by the nine has nothing to redo
    assert squashed["schema"].keys() == replaced["schema"].keys() and "queue_job" in squashed["schema"]
    for table in squashed["schema"]:
        assert squashed["schema"][table] == replaced["schema"][table], table
