"""Operator actions leave an audit trail (the actor in job and worker events), an operator can
forget a worker that is gone, and a worker that said goodbye shows as exited."""

import pytest

from jobqueue import selectors, services
from jobqueue.exceptions import InvalidRequest, NotFound
from jobqueue.models import Affinity, JobEvent, Worker, WorkerEvent
from tests.factories import claim, enqueue, make_task, register

pytestmark = pytest.mark.django_db

TIMEOUT = 30.0  # jobqueue.conf's default worker_timeout


def worker_events(worker_id: str) -> list[tuple[str, dict]]:
    return [(e.kind, e.detail) for e in WorkerEvent.objects.filter(worker_id=worker_id)]


def test_cancel_records_its_actor_queued_and_leased(clock):
    queued = enqueue()
    services.job_cancel(job_id=queued.pk, actor="alice")
    leased = enqueue()
    claim(register("w1"))
    services.job_cancel(job_id=leased.pk, actor="cli:bob")
    assert JobEvent.objects.get(job=queued, kind="cancelled").detail["actor"] == "alice"
    assert JobEvent.objects.get(job=leased, kind="cancel_requested").detail["actor"] == "cli:bob"


def test_drain_and_undrain_record_their_actor(clock):
    register("w1")
    services.worker_drain(worker_id="w1", actor="alice")
    services.worker_undrain(worker_id="w1", actor="cli:bob")
    assert worker_events("w1") == [("drain_requested", {"actor": "alice"}), ("drain_withdrawn", {"actor": "cli:bob"})]


def test_releasing_a_pin_records_the_key_and_actor_on_its_worker(clock):
    task = make_task()
    enqueue(task, affinity=True)
    claim(register("w1"))
    [pin] = Affinity.objects.all()
    assert services.affinity_release(key=pin.key, actor="alice")
    assert worker_events("w1") == [("affinity_released", {"key": pin.key, "actor": "alice"})]
    assert not services.affinity_release(key=pin.key, actor="alice")  # not pinned: nothing to record
    assert len(worker_events("w1")) == 1


def test_revoking_credentials_records_its_actor(clock):
    services.credential_issue(worker_id="w9")
    services.credentials_revoke(worker_id="w9", actor="alice")
    [(kind, detail)] = worker_events("w9")
    assert kind == "credentials_revoked" and detail["actor"] == "alice" and detail["credentials"] == 1


def test_the_queues_own_moves_name_no_actor(clock):
    job = enqueue()
    services.job_cancel(job_id=job.pk)
    assert "actor" not in JobEvent.objects.get(job=job, kind="cancelled").detail


def test_a_drained_worker_that_exits_shows_as_exited_not_healthy_then_stale(clock):
    worker = register("w1")
    services.worker_heartbeat(worker_id="w1", session=worker.session, draining=True, ready=True)
    worker.refresh_from_db()
    assert selectors.worker_health(worker, now=clock.now()) == "healthy"  # draining, still running
    services.worker_heartbeat(worker_id="w1", session=worker.session, draining=True, ready=False)  # its goodbye
    worker.refresh_from_db()
    assert selectors.worker_health(worker, now=clock.now()) == "exited"
    clock.advance(TIMEOUT * 10)
    assert selectors.worker_health(worker, now=clock.now()) == "exited"  # never turns stale
    [doc] = selectors.status_document()["workers"]
    assert doc["health"] == "exited"
    again = register("w1")
    assert selectors.worker_health(again, now=clock.now()) == "healthy"


def test_a_queued_job_names_an_exited_worker_in_its_reason(clock):
    worker = register("w1", pool="build")
    services.worker_heartbeat(worker_id="w1", session=worker.session, draining=True, ready=False)
    job = enqueue(pool="build")
    assert selectors.blocked_reasons() == [{"job_id": job.pk, "reason": "no healthy worker (exited: w1)"}]


def test_forgetting_a_stale_worker_takes_it_out_of_status_and_blocked_reasons(clock):
    register("w1", pool="build")
    job = enqueue(pool="build")
    clock.advance(TIMEOUT + 1)
    assert selectors.blocked_reasons()[0]["reason"] == "no healthy worker (stale: w1)"
    services.worker_forget(worker_id="w1", actor="alice")
    assert selectors.status_document()["workers"] == []
    assert selectors.blocked_reasons() == [{"job_id": job.pk, "reason": "no worker in pool build"}]
    assert Worker.objects.get(pk="w1").forgotten_at == clock.now()  # kept: its attempts are history
    [(kind, detail)] = worker_events("w1")
    assert kind == "forgotten" and detail["actor"] == "alice"


def test_a_forgotten_worker_that_registers_is_back(clock):
    register("w1")
    clock.advance(TIMEOUT + 1)
    services.worker_forget(worker_id="w1")
    register("w1")
    assert [w["worker_id"] for w in selectors.status_document()["workers"]] == ["w1"]


def test_a_forgotten_worker_that_heartbeats_is_back(clock):
    worker = register("w1")
    clock.advance(TIMEOUT + 1)
    services.worker_forget(worker_id="w1")
    services.worker_heartbeat(worker_id="w1", session=worker.session)
    assert [w["worker_id"] for w in selectors.status_document()["workers"]] == ["w1"]


def test_a_healthy_worker_is_not_forgotten(clock):
    register("w1")
    with pytest.raises(InvalidRequest, match="'w1' is healthy .*only a stale or exited worker can be forgotten"):
        services.worker_forget(worker_id="w1")
    assert Worker.objects.get(pk="w1").forgotten_at is None


def test_a_worker_holding_an_attempt_is_not_forgotten(clock):
    job = enqueue()
    claim(register("w1"))
    clock.advance(TIMEOUT + 1)  # stale, but its attempt is still active until the reaper runs
    with pytest.raises(InvalidRequest, match=f"still holds attempts of job {job.pk}"):
        services.worker_forget(worker_id="w1")
    services.leases_expire()
    services.worker_forget(worker_id="w1")


def test_forgetting_an_unknown_or_forgotten_worker_is_not_found(clock):
    with pytest.raises(NotFound):
        services.worker_forget(worker_id="nobody")
    register("w1")
    clock.advance(TIMEOUT + 1)
    services.worker_forget(worker_id="w1")
    with pytest.raises(NotFound):
        services.worker_forget(worker_id="w1")


def test_forgetting_a_worker_releases_the_tasks_pinned_to_it(clock):
    """The operator says it is gone: a pinned task's next job may go to any worker, not wait for it."""
    worker = register("w1")
    enqueue(affinity=True)
    [c] = claim(worker)
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    [pin] = Affinity.objects.all()
    clock.advance(TIMEOUT + 1)
    services.worker_forget(worker_id="w1", actor="alice")
    assert not Affinity.objects.exists()
    kinds = [(kind, detail.get("key"), detail.get("actor")) for kind, detail in worker_events("w1")]
    assert ("affinity_released", pin.key, "alice") in kinds
