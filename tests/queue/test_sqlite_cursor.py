"""jobqueue.sqlite_backend's cursor (the conversion of each statement cached, positional
parameters without the check for named ones) runs every statement as Django's would."""

import pytest
from django.db import connection

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite backend's cursor"),
]


@pytest.mark.parametrize(
    "statement, params",
    [
        ("SELECT %s + %s, '100%%'", [2, 3]),
        ("SELECT %s + %s, '100%%'", (2, 3)),
        ("SELECT %(a)s + %(b)s, '100%%'", {"a": 2, "b": 3}),
    ],
    ids=["list", "tuple", "mapping"],
)
def test_parameters_of_every_style_are_bound_and_a_doubled_percent_is_one(statement, params):
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        assert cursor.fetchone() == (5, "100%")


def test_a_statement_without_parameters_is_run_as_written():
    with connection.cursor() as cursor:
        cursor.execute("SELECT '100%'")
        assert cursor.fetchone() == ("100%",)


def test_executemany_binds_each_row():
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE t (a INTEGER)")
        cursor.executemany("INSERT INTO t (a) VALUES (%s)", [(1,), [2]])
        cursor.execute("SELECT SUM(a) FROM t")
        assert cursor.fetchone() == (3,)
