import pytest

from jobqueue import conf
from jobqueue.clock import FrozenClock, set_clock

pytest_plugins = ["tests.pg"]


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
