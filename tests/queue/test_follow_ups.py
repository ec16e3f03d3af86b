"""Follow-up jobs (jobqueue/services/followups.py): a job's follow-ups for a
terminal state are enqueued in the transaction that settles it in that
state — by a finish, an expiry or a cancel — once, and never for a state it
did not reach."""

import pytest

from jobqueue import services
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import Job, JobEvent, JobState
from jobqueue.services import followups
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def spec(name: str) -> dict:
    return {"key": f"hook:{name}", "payload": {"hook": name}, "project": "demo", "source": "hooks", "agent": "sh",
            "runner": "shell"}  # fmt: skip


HOOKS = {"succeeded": [spec("done")], "failed": [spec("failed")], "cancelled": [spec("cancelled")]}


def follow_up_keys() -> set[str]:
    return set(Job.objects.filter(key__startswith="hook:").values_list("key", flat=True))


def test_a_success_enqueues_the_success_follow_ups_once(clock):
    job = enqueue(follow_ups=HOOKS)
    [c] = claim(register("w1"))
    assert follow_up_keys() == set()  # nothing before the outcome
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    assert follow_up_keys() == {"hook:done"}
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")  # the same finish again
    assert Job.objects.filter(key="hook:done").count() == 1
    [enqueued] = JobEvent.objects.filter(job=job, kind="follow_ups_enqueued")
    assert enqueued.detail["state"] == "succeeded"


def test_a_failure_with_a_retry_left_enqueues_nothing_until_the_last(clock):
    from jobqueue.types import Retry

    enqueue(follow_ups=HOOKS, retry=Retry(max_attempts=2))
    worker = register("w1")
    [first] = claim(worker)
    services.attempt_finish(attempt_id=first.attempt_id, token=first.token, outcome="failed")
    assert follow_up_keys() == set()  # queued again: not an outcome
    clock.advance(600)
    [second] = claim(worker)
    services.attempt_finish(attempt_id=second.attempt_id, token=second.token, outcome="failed")
    assert follow_up_keys() == {"hook:failed"}


def test_an_expiry_that_fails_the_job_enqueues_the_failure_follow_ups(clock, queue_config):
    queue_config(lease_duration=5, max_attempts=1)
    enqueue(follow_ups=HOOKS, max_attempts=1)
    claim(register("w1"))
    clock.advance(6)
    services.leases_expire()
    assert follow_up_keys() == {"hook:failed"}


def test_cancelling_a_queued_job_enqueues_the_cancel_follow_ups(clock):
    job = enqueue(follow_ups=HOOKS)
    services.job_cancel(job_id=job.pk)
    assert follow_up_keys() == {"hook:cancelled"}
    assert Job.objects.get(key="hook:cancelled").state == JobState.QUEUED  # an ordinary job, claimable


def test_a_settle_that_fails_enqueues_no_follow_up(clock, monkeypatch):
    """One transaction: when anything after the follow-ups fails, neither the outcome nor them is kept."""
    job = enqueue(follow_ups=HOOKS)
    [c] = claim(register("w1"))
    original = services.attempts._freed

    def boom(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("crash after the follow-ups were written")

    monkeypatch.setattr(services.attempts, "_freed", boom)
    with pytest.raises(RuntimeError):
        services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    assert follow_up_keys() == set()
    assert Job.objects.get(pk=job.pk).state == JobState.LEASED


@pytest.mark.parametrize(
    "bad",
    [{"finished": [spec("x")]}, {"succeeded": spec("x")}, {"succeeded": [{"key": "k"}]},
     {"succeeded": [{**spec("x"), "colour": "red"}]}, {"succeeded": [spec(str(i)) for i in range(17)]}],
)  # fmt: skip
def test_bad_follow_ups_are_refused_at_enqueue(clock, bad):
    with pytest.raises(InvalidRequest) as refused:
        enqueue(follow_ups=bad)
    assert refused.value.details["field"] == "follow_ups"
    assert not Job.objects.exists()
    assert followups.MAX_FOLLOW_UPS == 16


def test_follow_ups_are_stamped_with_the_settling_services_clock(clock):
    import datetime as dt

    from jobqueue.clock import FrozenClock

    job = enqueue(follow_ups=HOOKS)
    later = FrozenClock(clock.now() + dt.timedelta(hours=3))  # not the process-wide clock
    services.job_cancel(job_id=job.pk, clock=later)
    hook = Job.objects.get(key="hook:cancelled")
    assert hook.created_at == hook.available_at == later.now()
    assert JobEvent.objects.get(job=job, kind="follow_ups_enqueued").at == later.now()
