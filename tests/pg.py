"""pytest plugin: run the suite on a throwaway PostgreSQL cluster.

`APIARY_TEST_DB=postgres pytest tests/queue` starts one cluster per session
(tests.pgcluster; one per xdist worker) and points Django's default database
at it before pytest-django creates the test database, so every test that
uses the database runs on PostgreSQL. Without the server binaries every test
is skipped with a visible reason, unless `APIARY_REQUIRE_POSTGRES=1` (CI),
which makes that a usage error instead.

`live_database_url` gives subprocess tests the URL of the live test database.
"""

import os
import re
from urllib.parse import quote

import pytest

from tests import pgcluster

MISSING = (
    "PostgreSQL server binaries not found (looked at $APIARY_PG_BINDIR or pg_config --bindir, "
    "/usr/lib/postgresql/*/bin, PATH); install the postgresql package to run APIARY_TEST_DB=postgres"
)
TEST_DB_NAME = "test_apiary"

# What this process knows about the backend, for the header and the summary.
_state: dict = {"bindir": None, "cluster": None, "version": None}


def postgres_requested() -> bool:
    return os.environ.get("APIARY_TEST_DB", "").lower() in ("postgres", "postgresql")


def postgres_required() -> bool:
    return os.environ.get("APIARY_REQUIRE_POSTGRES") == "1"


def pytest_configure(config: pytest.Config) -> None:
    if not postgres_requested():
        return
    _state["bindir"] = pgcluster.find_bindir()
    if _state["bindir"] is None:
        if postgres_required():
            raise pytest.UsageError(f"APIARY_REQUIRE_POSTGRES=1: {MISSING}")
        return
    _state["version"] = pgcluster.server_version(_state["bindir"])


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not postgres_requested():
        return ["apiary test database: sqlite (set APIARY_TEST_DB=postgres for PostgreSQL)"]
    if _state["bindir"] is None:
        return [f"apiary test database: postgresql requested, but SKIPPED: {MISSING}"]
    return [f"apiary test database: postgresql {_state['version']} (throwaway cluster from {_state['bindir']})"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if postgres_requested() and _state["bindir"] is None:
        skip = pytest.mark.skip(reason=MISSING)
        for item in items:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not postgres_requested():
        line = "sqlite"
    elif _state["bindir"] is None:
        line = f"postgresql requested but not available, tests skipped: {MISSING}"
    elif _state["cluster"] is not None:
        cluster = _state["cluster"]
        line = f"postgresql {_state['version']} (throwaway cluster at {cluster.host}:{cluster.port})"
    else:
        line = "postgresql (no test in this process needed the database, or it ran in xdist workers)"
    terminalreporter.write_sep("-", f"apiary test database: {line}")


@pytest.fixture(scope="session")
def apiary_pg_cluster():
    """The session's throwaway cluster (only when APIARY_TEST_DB=postgres)."""
    cluster = pgcluster.start_cluster()
    _state["cluster"] = cluster
    try:
        yield cluster
    finally:
        cluster.stop()


def _point_default_at(url: str) -> None:
    """Make Django's default database `url`, before any test database exists.

    `connections.settings` is a cached_property holding the settings dicts,
    and a connection already created keeps its own `settings_dict`, so both
    are reset, not just settings.DATABASES."""
    from django.conf import settings
    from django.db import connections

    from apiary_site.settings import _postgres

    default = _postgres(url)
    default["TEST"] = {"NAME": TEST_DB_NAME}
    settings.DATABASES = {**settings.DATABASES, "default": default}
    if hasattr(connections._connections, "default"):
        connections["default"].close()
        del connections["default"]
    connections.__dict__.pop("settings", None)  # the cached_property
    connections._settings = None  # re-read settings.DATABASES …
    connections.settings  # noqa: B018 — … and fill in Django's defaults now


def _sqlite_test_db_in_a_file(path) -> None:
    """Django's default SQLite test database is `file:memorydb_default?mode=memory&cache=shared`.
    In shared-cache mode connections lock whole tables against each other and get
    SQLITE_LOCKED ("database table is locked") at once, busy timeout or not, and WAL
    does not apply to memory databases. Tests where a thread (a worker runtime's job
    thread) writes while the test's own connection reads failed at random. A file
    gives the settings the app runs with (WAL, busy timeout, BEGIN IMMEDIATE)."""
    from django.conf import settings

    default = settings.DATABASES["default"]
    if default["ENGINE"] in ("django.db.backends.sqlite3", "jobqueue.sqlite_backend") and not default.get("TEST", {}).get("NAME"):
        default.setdefault("TEST", {})["NAME"] = str(path)
        if "APIARY_SQLITE_SYNCHRONOUS" not in os.environ:  # a throwaway file needs no fsync per commit
            options = default.setdefault("OPTIONS", {})
            options["init_command"] = re.sub(r"PRAGMA synchronous=\w+;", "PRAGMA synchronous=OFF;", options.get("init_command", ""))


@pytest.fixture(scope="session")
def django_db_modify_db_settings(request: pytest.FixtureRequest) -> None:
    """pytest-django's hook for changing database settings just before the
    test databases are created; overridden to switch to the cluster."""
    if postgres_requested():
        cluster = request.getfixturevalue("apiary_pg_cluster")
        _point_default_at(cluster.url("postgres"))
    else:
        _sqlite_test_db_in_a_file(request.getfixturevalue("tmp_path_factory").mktemp("sqlite") / "test_apiary.sqlite3")
    # What pytest-django's own version does: suffix test DB names per xdist worker / tox env.
    request.getfixturevalue("django_db_modify_db_settings_parallel_suffix")


@pytest.fixture
def live_database_url(transactional_db) -> str | None:
    """URL of the live test database for subprocesses, on PostgreSQL.

    The test runs as a TransactionTestCase, so rows the subprocesses commit
    are real and are flushed afterwards. None on SQLite (a file only this
    process should write to): give subprocesses their own database file instead."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    s = connection.settings_dict
    user = quote(s["USER"] or "", safe="")
    password = f":{quote(s['PASSWORD'], safe='')}" if s["PASSWORD"] else ""
    return f"postgres://{user}{password}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{quote(s['NAME'], safe='')}"
