"""A job's payload: stored as given, handed to every claim unchanged, never read by the queue."""

import pytest

from jobqueue import services
from jobqueue.api.serializers import ClaimedJob, claimed_job
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import Job
from jobqueue.types import CLAIM_FIELDS
from tests.factories import claim, register, snapshot

pytestmark = pytest.mark.django_db

QUEUE = dict(agent="a", runner="shell", project="p", source="s", capabilities=["apiary.workflow", "runner:shell"])


def test_every_claim_gets_the_payload_as_it_was_enqueued(clock, queue_config):
    queue_config(lease_duration=30)
    payload = {"nested": {"list": [1, "two", None]}, "text": "caf\u00e9 \u2603", "nul": "a\x00b"}
    job, _ = services.job_enqueue(key="k", payload=payload, **QUEUE)
    worker = register("w1")
    [first] = claim(worker)
    clock.advance(31)
    services.leases_expire()
    [second] = claim(worker)
    stored = {**payload, "nul": "a\ufffdb"}  # NUL is not storable: it becomes U+FFFD
    assert first.payload == second.payload == stored == Job.objects.get(pk=job.pk).payload
    assert claimed_job(first) | {"token": ""} == {**stored, **ClaimedJob(first).data, "token": ""}


@pytest.mark.parametrize("payload", [[1, 2], "text", None, 7])
def test_a_payload_that_is_not_an_object_is_refused_and_nothing_is_written(clock, payload):
    before = snapshot()
    with pytest.raises(InvalidRequest, match="payload must be a JSON object"):
        services.job_enqueue(key="k", payload=payload, **QUEUE)
    assert snapshot() == before


@pytest.mark.parametrize("field", sorted(CLAIM_FIELDS))
def test_a_payload_key_that_is_a_queue_field_is_refused(clock, field):
    # The protocol sends payload keys beside the queue's own: a clash would overwrite one.
    before = snapshot()
    with pytest.raises(InvalidRequest, match="queue's own"):
        services.job_enqueue(key="k", payload={field: "x"}, **QUEUE)
    assert snapshot() == before


def test_the_queue_fields_of_a_claim_are_the_wires(clock):
    assert set(ClaimedJob().fields) == CLAIM_FIELDS
