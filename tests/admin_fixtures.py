"""Fixtures the admin's tests share (a pytest plugin: tests/conftest.py loads it)."""

import pytest

from tests.factories import claim, enqueue, instance_id, make_task, register
from workflows.models import StepRun


@pytest.fixture
def admin_fast_passwords(settings):
    # admin_client creates a superuser per test; the default hasher costs ~0.5 s each.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def busy_queue(clock):
    """A running job with an attempt, a queued job, a pinned task, step history."""
    worker = register("w1", pool="build", capacity=2)
    task = make_task()
    running = enqueue(task, affinity=True, pool="build")
    [c] = claim(worker)
    queued = enqueue(pool="build", labels=["linux"])
    StepRun.objects.create(
        instance_id=instance_id(running), attempt_number=1, step_id="plan", status="running", started_at=clock.now()
    )
    return {"worker": worker, "task": task, "running": running, "queued": queued, "claim": c}
