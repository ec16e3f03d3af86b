"""Django's SQLite backend, with each statement's placeholder conversion done once.

Django's SQLite cursor rewrites every statement's `%s` placeholders to `?` with
a regular expression on every execute. The queue's statements are a few dozen
fixed strings run thousands of times a second, so the conversion is cached
here (bounded: the ORM's statements vary with IN-list lengths), and a statement with positional
parameters skips the check for named ones. Everything else is Django's backend unchanged,
execute wrappers and query logging included.
"""

import functools
import sqlite3

from django.db.backends.sqlite3 import base


@functools.lru_cache(maxsize=4096)
def _qmark(query: str) -> str:
    return base.FORMAT_QMARK_REGEX.sub("?", query).replace("%%", "%")


class SQLiteCursorWrapper(base.SQLiteCursorWrapper):
    def execute(self, query, params=None):
        # Positional parameters, as every statement of the queue's has: Django's check for a
        # mapping (an ABC's isinstance) costs more than the cached conversion, so it is skipped.
        if params.__class__ is list or params.__class__ is tuple:
            return sqlite3.Cursor.execute(self, _qmark(query), params)
        return super().execute(query, params)

    def convert_query(self, query, *, param_names=None):
        if param_names is None:
            return _qmark(query)
        return super().convert_query(query, param_names=param_names)


class DatabaseWrapper(base.DatabaseWrapper):
    def create_cursor(self, name=None):
        return self.connection.cursor(factory=SQLiteCursorWrapper)
