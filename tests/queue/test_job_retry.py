"""An operator's retry (services.job_retry): a failed or cancelled job is queued again as
itself — same key, same journal — as a new attempt with a fresh budget, and its follow-ups
are enqueued once per outcome; a succeeded or unfinished job refuses."""

import pytest

from jobqueue import services
from jobqueue.exceptions import InvalidRequest, NotFound
from jobqueue.models import Attempt, Job, JobEvent, JobState
from jobqueue.services.records import job_records, records_of_job
from jobqueue.types import Retry
from tests.factories import claim, enqueue, register
from tests.queue.test_follow_ups import HOOKS, follow_up_keys

pytestmark = pytest.mark.django_db


def failed_job(**kwargs):
    job = enqueue(**kwargs)
    worker = register("w1")
    [c] = claim(worker)
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", error="boom")
    return Job.objects.get(pk=job.pk), worker, c


def test_a_failed_job_is_queued_again_as_itself(clock):
    job, worker, first = failed_job()
    assert job.state == JobState.FAILED and job.reason == "boom"
    clock.advance(5)
    retried = services.job_retry(job_id=job.pk, actor="alice")
    assert (retried.pk, retried.key, retried.state) == (job.pk, job.key, JobState.QUEUED)
    assert (retried.finished_at, retried.reason, retried.current_attempt_id) == (None, "", None)
    assert retried.available_at == clock.now()
    assert Job.objects.filter(key=job.key).count() == 1  # the enqueuer's dedup still holds
    [again] = claim(worker)
    assert again.job_id == job.pk
    assert Attempt.objects.get(pk=again.attempt_id).number == 2  # a new attempt, after the last
    [event] = JobEvent.objects.filter(job=job, kind="retried")
    assert event.detail == {"actor": "alice", "previous_state": "failed", "previous_reason": "boom", "attempts_before": 1}


def test_a_cancelled_job_can_be_retried_and_its_cancel_request_is_gone(clock):
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    services.job_cancel(job_id=job.pk, actor="alice")
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    services.job_retry(job_id=job.pk, actor="alice")
    [again] = claim(worker)
    beat = services.attempt_heartbeat(attempt_id=again.attempt_id, token=again.token)
    assert beat.cancel is False  # the old request would cancel the new attempt at its first heartbeat
    services.attempt_finish(attempt_id=again.attempt_id, token=again.token, outcome="succeeded")
    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED


def test_a_succeeded_job_refuses_with_a_clear_error(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    with pytest.raises(InvalidRequest, match=f"job {job.pk} succeeded: only a failed or cancelled job can be retried"):
        services.job_retry(job_id=job.pk)
    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
    assert not JobEvent.objects.filter(job=job, kind="retried").exists()


@pytest.mark.parametrize("leased", [False, True], ids=["queued", "leased"])
def test_an_unfinished_job_refuses(clock, leased):
    job = enqueue()
    if leased:
        claim(register("w1"))
    state = "leased" if leased else "queued"
    with pytest.raises(InvalidRequest, match=f"job {job.pk} is {state}, not finished"):
        services.job_retry(job_id=job.pk)


def test_an_unknown_job_is_not_found(clock):
    with pytest.raises(NotFound, match="no job 999"):
        services.job_retry(job_id=999)


def test_the_retry_policy_counts_only_attempts_after_the_retry(clock):
    """Without a fresh budget, one failure with `max_attempts: 2` already behind it would fail at once."""
    job, worker, _ = failed_job(retry=Retry(max_attempts=1))
    services.job_retry(job_id=job.pk)
    [again] = claim(worker)
    services.attempt_finish(attempt_id=again.attempt_id, token=again.token, outcome="failed")
    assert Job.objects.get(pk=job.pk).state == JobState.FAILED  # its own budget of 1, spent

    job2, worker2, _ = failed_job(retry=Retry(max_attempts=2, backoff=1))
    # failed_job's first finish left a retry: it is queued; claim and fail it for good
    clock.advance(10)
    [second] = claim(worker2)
    services.attempt_finish(attempt_id=second.attempt_id, token=second.token, outcome="failed")
    assert Job.objects.get(pk=job2.pk).state == JobState.FAILED
    services.job_retry(job_id=job2.pk)
    [third] = claim(worker2)
    services.attempt_finish(attempt_id=third.attempt_id, token=third.token, outcome="failed")
    assert Job.objects.get(pk=job2.pk).state == JobState.QUEUED  # 1 failure of 2 since the retry: a retry left


def test_max_attempts_counts_only_expiries_after_the_retry(clock, queue_config):
    queue_config(lease_duration=5, max_attempts=2)
    job = enqueue(max_attempts=2)
    worker = register("w1")
    for _ in range(2):
        claim(worker)
        clock.advance(6)
        services.leases_expire()
    assert Job.objects.get(pk=job.pk).state == JobState.FAILED
    services.job_retry(job_id=job.pk)
    claim(worker)
    clock.advance(6)
    services.leases_expire()
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED  # 1 expiry of 2 since the retry


def test_the_journal_holds_across_the_retry(clock):
    """Done records stay done: a later attempt reads them and skips what is done (a done publish never runs again)."""
    job = enqueue()
    worker = register("w1")
    [c] = claim(worker)
    services.job_record(attempt_id=c.attempt_id, token=c.token, key="publish:open-pr", state="done", value={"output": "pr/1"})
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed")
    services.job_retry(job_id=job.pk)
    [again] = claim(worker)
    [record] = job_records(attempt_id=again.attempt_id, token=again.token)
    assert (record.key, record.state, record.value) == ("publish:open-pr", "done", {"output": "pr/1"})
    redo = services.job_record(attempt_id=again.attempt_id, token=again.token, key="publish:open-pr", state="started")
    assert redo.already_done
    assert records_of_job(job.pk)["publish:open-pr"].attempt_number == 1


def test_a_retried_job_that_succeeds_enqueues_its_success_follow_ups(clock):
    job, worker, _ = failed_job(follow_ups=HOOKS)
    assert follow_up_keys() == {"hook:failed"}  # the failure hook ran for its first end
    services.job_retry(job_id=job.pk)
    [again] = claim(worker)
    services.attempt_finish(attempt_id=again.attempt_id, token=again.token, outcome="succeeded")
    assert follow_up_keys() == {"hook:failed", "hook:done"}


def test_a_retried_job_that_fails_again_does_not_run_its_failure_hook_twice(clock):
    job, worker, _ = failed_job(follow_ups=HOOKS)
    services.job_retry(job_id=job.pk)
    [again] = claim(worker)
    services.attempt_finish(attempt_id=again.attempt_id, token=again.token, outcome="failed")
    assert Job.objects.filter(key="hook:failed").count() == 1
    assert Job.objects.get(pk=job.pk).state == JobState.FAILED


def test_a_retry_wakes_a_waiting_claim(clock, monkeypatch):
    """The job is claimable at once: the retry announces it, as an enqueue does."""
    from jobqueue.services import jobs

    job, _, _ = failed_job()
    seen = []
    monkeypatch.setattr(jobs, "emit", lambda cursor, wake: seen.append(wake))
    services.job_retry(job_id=job.pk)
    assert [w.requirements for w in seen] == [job.requirements_id]
