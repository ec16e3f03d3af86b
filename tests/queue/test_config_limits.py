"""Claims under the limits that a loaded apiary.yaml puts in force.

The limits are read by the real loader (`workflows.config.load`) and
installed as `apiary run` installs them; jobs and workers come from the
factories, claims go through `jobqueue.services`. A frozen clock, no sleeps.
"""

import textwrap

import pytest

from jobqueue import conf
from jobqueue.models import Job, JobState
from jobqueue.selectors import blocked_reasons
from tests.factories import claim, enqueue, register
from workflows import config as cfg

pytestmark = pytest.mark.django_db


@pytest.fixture
def load_config(tmp_path):
    """Load an apiary.yaml text and put its queue settings in force for the test."""
    previous = conf.current()

    def load(text: str) -> cfg.Config:
        path = tmp_path / "apiary.yaml"
        path.write_text(textwrap.dedent(text))
        config = cfg.load(path, environ={})
        conf.configure(config.queue_config())
        return config

    yield load
    conf.configure(previous)


def fleet_claims(*, project: str, workers: int, capacity: int, queued: int) -> int:
    """Enqueue `queued` jobs of `project`, let `workers` idle workers of
    `capacity` each claim until none gets more; the number of leased jobs."""
    for _ in range(queued):
        enqueue(project=project)
    fleet = [register(f"w{i}", capacity=capacity) for i in range(workers)]
    while any([claim(w, max_jobs=capacity) for w in fleet]):
        pass
    return Job.objects.filter(state=JobState.LEASED).count()


@pytest.mark.parametrize(
    ("workers", "capacity", "queued"),
    [
        (10, 4, 60),  # more jobs than the fleet holds: every slot is used
        (10, 4, 25),  # fewer: every job runs
        (3, 2, 6),  # exactly a full fleet
    ],
)
def test_with_the_default_config_a_fleet_is_used_to_its_capacity(clock, load_config, workers, capacity, queued):
    config = load_config("project: hello\n")
    leased = fleet_claims(project=config.project, workers=workers, capacity=capacity, queued=queued)
    assert leased == min(workers * capacity, queued)
    if queued > workers * capacity:
        # What waits, waits for capacity, and status says so (not a limit).
        assert set(b["reason"] for b in blocked_reasons()) == {"all eligible workers are at capacity"}
    else:
        assert blocked_reasons() == []


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("project: hello\nsettings: {concurrency: 2}\n", 2),
        ("project: hello\nsettings: {concurrency: 7, queue: {concurrency: {default_project: 3}}}\n", 3),
        ("project: hello\nsettings: {queue: {concurrency: {default_project: 5}}}\n", 5),
        ("project: hello\nsettings: {concurrency: 2, queue: {concurrency: {projects: {hello: 9}}}}\n", 9),
    ],
)
def test_an_explicit_project_limit_still_holds_a_fleet_back(clock, load_config, text, limit):
    config = load_config(text)
    leased = fleet_claims(project=config.project, workers=10, capacity=4, queued=30)
    assert leased == limit
