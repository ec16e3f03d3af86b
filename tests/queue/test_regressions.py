"""Bugs found once, pinned so they stay fixed."""

import pytest

from jobqueue.conf import Limits
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def test_a_full_pool_limit_does_not_hide_jobs_without_a_pool(clock, queue_config):
    # Found by the stateful test on PostgreSQL: the claim excluded saturated keys
    # with `pool NOT IN (…)`, which is never true for a job whose pool is NULL.
    queue_config(limits=Limits(overrides={"pool": {"build": 1}}))
    builds = [enqueue(pool="build") for _ in range(3)]
    anywhere = enqueue()
    worker = register("w1", pool="build", capacity=4)
    claimed = {c.job_id for c in claim(worker, max_jobs=3)}
    assert claimed == {builds[0].pk, anywhere.pk}
