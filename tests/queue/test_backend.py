"""The session really runs on the backend it claims (tests/pg.py switches it)."""

import os

import pytest
from django.db import connection

from tests.pg import postgres_requested

pytestmark = pytest.mark.django_db


def test_the_requested_backend_is_the_one_in_use():
    if not postgres_requested():
        # Without the switch, settings decide: DATABASE_URL=postgres://… or SQLite.
        assert connection.vendor == ("postgresql" if os.environ.get("DATABASE_URL") else "sqlite")
        return
    assert connection.vendor == "postgresql"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_database(), current_setting('fsync'), current_setting('transaction_isolation'),"
            " current_setting('max_connections')::int, inet_server_addr()::text"
        )
        database, fsync, isolation, max_connections, address = cursor.fetchone()
    assert database.startswith("test_")  # pytest-django's test database, not the cluster's `postgres`
    assert fsync == "on"
    assert isolation == "read committed"  # what the claim's limit locking is proven under
    assert max_connections >= 100
    assert address.startswith("127.0.0.1")
