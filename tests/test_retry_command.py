"""`apiary retry INSTANCE` re-queues a failed or cancelled instance; every operator command
names its actor (`cli:<os user>`) in the events it writes."""

import getpass

import pytest
from django.core.management import CommandError

from apiary_site import cli
from jobqueue import services
from jobqueue.models import Job, JobEvent, JobState, WorkerEvent
from tests.factories import claim, enqueue, instance_id, make_task, register, task_id
from tests.test_ops_commands import apiary, no_ambient_config  # noqa: F401 - the fixture, for these commands too

pytestmark = pytest.mark.django_db

ACTOR = f"cli:{getpass.getuser()}"


def failed(job):
    [c] = claim(register("w1"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", error="boom")


def test_retry_requeues_a_failed_instance(clock):
    job = enqueue()
    failed(job)
    out = apiary("retry", str(instance_id(job)))
    assert out.strip() == f"instance {instance_id(job)} (job {job.pk}) was failed; queued again, its next run is attempt 2"
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    assert JobEvent.objects.get(job=job, kind="retried").detail["actor"] == ACTOR


def test_retry_of_a_succeeded_instance_says_why_not(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    with pytest.raises(CommandError, match=f"instance {instance_id(job)}: job {job.pk} succeeded: only a failed or cancelled"):
        apiary("retry", str(instance_id(job)))


def test_retry_of_an_unknown_instance_names_it(clock):
    with pytest.raises(CommandError, match="no workflow instance 4242"):
        apiary("retry", "4242")


def test_retry_is_in_the_usage():
    assert "retry INSTANCE" in cli.USAGE


def test_cancel_drain_and_release_name_the_cli_user(clock):
    task = make_task()
    job = enqueue(task, affinity=True)
    claim(register("w1"))
    apiary("cancel", str(instance_id(job)))
    apiary("worker", "drain", "w1")
    apiary("worker", "undrain", "w1")
    apiary("affinity", "release", str(task_id(job)))
    assert JobEvent.objects.get(job=job, kind="cancel_requested").detail["actor"] == ACTOR
    assert [(e.kind, e.detail.get("actor")) for e in WorkerEvent.objects.filter(worker_id="w1")] == [
        ("drain_requested", ACTOR), ("drain_withdrawn", ACTOR), ("affinity_released", ACTOR),
    ]  # fmt: skip
