"""A job's journal (jobqueue/services/records.py): only the current, live
attempt writes; a later attempt learns that an earlier one started something;
`done` is final and its value is what later attempts reuse."""

import pytest

from jobqueue import conf, services
from jobqueue.exceptions import InvalidRequest, SessionSuperseded, StaleAttempt
from jobqueue.models import JobRecord
from jobqueue.services.records import MAX_VALUE_BYTES, job_record, job_records, records_of_job
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db


def held(clock, worker_id="w1"):
    job = enqueue()
    worker = register(worker_id)
    [c] = claim(worker)
    return job, worker, c


def write(c, key, state, value=None):
    return job_record(attempt_id=c.attempt_id, token=c.token, key=key, state=state, value=value)


def test_a_record_of_the_current_attempt_is_kept(clock):
    job, _, c = held(clock)
    record = write(c, "step:plan", "done", {"output": "a plan"})
    assert (record.state, record.value, record.attempt_number, record.already_done) == ("done", {"output": "a plan"}, 1, False)
    assert records_of_job(job.pk)["step:plan"].value == {"output": "a plan"}
    assert [r.key for r in job_records(attempt_id=c.attempt_id, token=c.token)] == ["step:plan"]


def test_done_is_final_and_answers_what_was_recorded(clock):
    job, worker, c = held(clock)
    write(c, "publish:open-pr", "done", {"output": "https://example/pr/1"})
    again = write(c, "publish:open-pr", "started")
    assert again.already_done and again.state == "done" and again.value == {"output": "https://example/pr/1"}
    over = write(c, "publish:open-pr", "done", {"output": "another"})
    assert over.already_done and JobRecord.objects.get().value == {"output": "https://example/pr/1"}


def test_a_later_attempt_learns_an_earlier_one_started_it(clock, queue_config):
    queue_config(lease_duration=5)
    job, worker, first = held(clock)
    assert not write(first, "publish:deploy", "started").started_earlier
    clock.advance(6)
    services.leases_expire()
    [second] = claim(worker)
    restarted = write(second, "publish:deploy", "started")
    assert restarted.started_earlier and restarted.started_by == 1 and restarted.attempt_number == 2
    # The same write resent (its answer was lost) still says so: started_by stays the first starter.
    resent = write(second, "publish:deploy", "started")
    assert resent.started_earlier and resent.started_by == 1
    done = write(second, "publish:deploy", "done", {"output": "ok"})
    assert (done.state, done.started_by, done.attempt_number, done.already_done) == ("done", 1, 2, False)


@pytest.mark.parametrize("how", ["expired", "superseded", "wrong-token", "finished"])
def test_a_stale_attempt_records_nothing(clock, queue_config, how):
    queue_config(lease_duration=5)
    job, worker, c = held(clock)
    if how == "expired":
        clock.advance(6)
    elif how == "superseded":
        register("w1")
    elif how == "finished":
        services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    token = "not-the-token" if how == "wrong-token" else c.token
    with pytest.raises(SessionSuperseded if how == "superseded" else StaleAttempt):
        job_record(attempt_id=c.attempt_id, token=token, key="step:plan", state="done", value={"output": "late"})
    assert not JobRecord.objects.exists()


def test_another_workers_credential_records_nothing(clock):
    from jobqueue.exceptions import WorkerMismatch

    _, _, c = held(clock)
    with pytest.raises(WorkerMismatch):
        job_record(attempt_id=c.attempt_id, token=c.token, key="k", state="done", acting_as="w2")
    assert not JobRecord.objects.exists()


@pytest.mark.parametrize(
    ("key", "state", "value", "field"),
    [("", "done", {}, "key"), ("k" * 256, "done", {}, "key"), ("k", "finished", {}, "state"),
     ("k", "done", {"output": "x" * MAX_VALUE_BYTES}, "value")],
)  # fmt: skip
def test_bad_records_are_refused_naming_the_field(clock, key, state, value, field):
    _, _, c = held(clock)
    with pytest.raises(InvalidRequest) as refused:
        job_record(attempt_id=c.attempt_id, token=c.token, key=key, state=state, value=value)
    assert refused.value.details["field"] == field
    assert not JobRecord.objects.exists()


def test_records_outlive_the_attempt_that_wrote_them(clock):
    """A later attempt of the same job reads what an earlier one recorded (the resume case)."""
    conf.configure(conf.QueueConfig(lease_duration=5))
    try:
        job, worker, first = held(clock)
        write(first, "step:plan", "done", {"output": "plan v1"})
        clock.advance(6)
        services.leases_expire()
        [second] = claim(worker)
        assert {r.key: r.value for r in job_records(attempt_id=second.attempt_id, token=second.token)} == {
            "step:plan": {"output": "plan v1"}
        }
    finally:
        conf.configure(conf.QueueConfig())


def test_nul_and_lone_surrogates_are_stored_as_replacement_characters(clock):
    """PostgreSQL's jsonb refuses NUL: a checkpoint or a spawn line with one was a DataError."""
    job, _, c = held(clock)
    record = write(c, "spawn:split", "done", {"children": [{"title": "a\x00b\ud800"}]})
    assert record.value == {"children": [{"title": "a\ufffdb\ufffd"}]}
    services.attempt_heartbeat_with_checkpoint(attempt_id=c.attempt_id, token=c.token, step="three", content="x\x00y")
    assert records_of_job(job.pk)["checkpoint:three"].value == {"content": "x\ufffdy"}


def test_a_journal_holds_a_bounded_number_of_keys(clock, monkeypatch):
    """One attempt's token cannot make the control plane store records without end."""
    from jobqueue.services import records

    monkeypatch.setattr(records, "MAX_RECORDS_PER_JOB", 3)
    job, worker, c = held(clock)
    for n in range(3):
        write(c, f"step:s{n}", "done", {"output": n})
    with pytest.raises(InvalidRequest, match="at most 3 keys"):
        write(c, "spawn:more", "done", {"children": []})
    assert write(c, "step:s0", "done").already_done  # an existing key still answers
    assert JobRecord.objects.filter(job=job).count() == 3
