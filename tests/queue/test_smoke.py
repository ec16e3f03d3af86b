import pytest

from jobqueue import services
from jobqueue.models import JobState
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def test_enqueue_claim_finish(clock):
    job = enqueue()
    worker = register()
    [c] = claim(worker)
    assert c.job_id == job.pk
    hb = services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token)
    assert not hb.cancel
    assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded") == JobState.SUCCEEDED
    assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded") == JobState.SUCCEEDED
