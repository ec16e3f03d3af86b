"""Migrations that drop the index Django gives a foreign key where another index leads
with the same column: that one covers every lookup by it (and the cascade of a delete),
and each index is one more B-tree page written by every insert; or that replace it with
a partial one where most rows hold NULL (queue 0012), which no lookup by a value needs. (Queue 0011 is the one
exception: a partial index covers the job class's look-ups, all of queued jobs, and no
class is ever deleted; its docstring says why that is enough.) Dropped by name, since
on SQLite AlterField would copy the whole table to drop an index; on PostgreSQL
CONCURRENTLY (outside a transaction: the migration says `atomic = False`), so live
claims are not queued behind a table lock. Names ending in `_like` (the
varchar_pattern_ops twin Django makes for a text key) exist on PostgreSQL only."""

from django.db import migrations


def create_index(schema_editor, name: str, on: str, *, unique: bool = False) -> None:
    """CREATE [UNIQUE] INDEX `name` `on` unless it exists, CONCURRENTLY on PostgreSQL. A
    CONCURRENTLY build that was interrupted leaves an invalid index behind, which no query
    uses but every insert still writes, and which IF NOT EXISTS would take for the finished
    one: that one is dropped and built again."""
    postgres = schema_editor.connection.vendor == "postgresql"
    if postgres and _invalid_on_postgresql(schema_editor, name):
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
    how = "CONCURRENTLY " if postgres else ""
    schema_editor.execute(f'CREATE {"UNIQUE " if unique else ""}INDEX {how}IF NOT EXISTS "{name}" {on}')


def drop_index(schema_editor, name: str) -> None:
    how = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f'DROP INDEX {how}IF EXISTS "{name}"')


def _invalid_on_postgresql(schema_editor, name: str) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_table_is_visible(c.oid)",
            [name],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def dropping(indexes: list[tuple[str, str]]) -> migrations.RunPython:
    """A RunPython that drops `indexes` ((name, its CREATE INDEX columns: 'ON "t" ("c")')),
    and makes them again when the migration is reversed."""

    def found(schema_editor):
        postgres = schema_editor.connection.vendor == "postgresql"
        return [(name, on) for name, on in indexes if postgres or not name.endswith("_like")]

    def drop(apps, schema_editor):
        for name, _on in found(schema_editor):
            drop_index(schema_editor, name)

    def restore(apps, schema_editor):
        for name, on in found(schema_editor):
            create_index(schema_editor, name, on)

    return migrations.RunPython(drop, restore)


def replacing(old: tuple[str, str], new: tuple[str, str]) -> migrations.RunPython:
    """A RunPython that makes index `new` and then drops `old` (each (name, its CREATE INDEX
    tail: 'ON "t" ("c") WHERE …'), so a lookup always has one of them; reversed, the other way."""

    def swap(schema_editor, make: tuple[str, str], drop: str) -> None:
        create_index(schema_editor, *make)
        drop_index(schema_editor, drop)

    return migrations.RunPython(
        lambda apps, schema_editor: swap(schema_editor, new, old[0]),
        lambda apps, schema_editor: swap(schema_editor, old, new[0]),
    )
