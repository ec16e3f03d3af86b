import pytest

from jobqueue import conf
from jobqueue.clock import FrozenClock, set_clock

pytest_plugins = ["tests.pg", "tests.admin_fixtures"]


@pytest.fixture
def clock():
    """A frozen clock installed for every service call; tests `advance()` it."""
    frozen = FrozenClock()
    previous = set_clock(frozen)
    yield frozen
    set_clock(previous)


@pytest.fixture
def queue_config():
    """Install queue settings for one test: `queue_config(lease_duration=5, limits=…)`."""
    previous = conf.current()

    def install(**fields):
        conf.configure(conf.QueueConfig(**fields))
        return conf.current()

    yield install
    conf.configure(previous)


@pytest.fixture(autouse=True)
def _fresh_requirement_cache():
    """The claim caches requirement sets per process, by id, as immutable rows.
    Tests roll back or flush between each other and SQLite then hands the same
    ids to different sets, so every test starts with an empty cache."""
    from jobqueue import services  # needs the app registry, ready only once pytest-django set Django up

    services.requirement_cache.reset()
    yield
    services.requirement_cache.reset()


@pytest.fixture(autouse=True)
def _fresh_notifier():
    """Waiters, delayed wakes and memos of one test never reach the next."""
    from jobqueue.wakeup import notifier

    notifier.reset()
    yield
    notifier.reset()


@pytest.fixture(scope="session")
def asgi_server():
    """The listener's ASGI application on a thread of this process (tests/asgi_server.py)."""
    from tests.asgi_server import AsgiServer

    with AsgiServer() as server:
        yield server


@pytest.fixture(scope="session", autouse=True)
def _wakeup_watcher_stops(django_db_setup, django_db_blocker):
    """The wake-up watcher's own connection closes before the test database is dropped, and on
    PostgreSQL so does any other a test's threads left open (the ASGI server's, a long poll's):
    DROP DATABASE refuses a database others are connected to."""
    yield
    from django.db import connection

    from jobqueue.wakeup import watch

    watch.stop()
    if connection.vendor == "postgresql":
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
