"""Long-poll claims (`wait` > 0): poll until a job is claimable or `wait`
passes, holding no transaction and no write lock while waiting."""

import threading

import pytest
from django.db import connection

from jobqueue import longpoll, services
from tests.factories import enqueue, register


class FakeTime:
    """Monotonic time that moves only when the long-poll sleeps."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep = None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        if self.on_sleep:
            self.on_sleep(len(self.sleeps))
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(longpoll, "_monotonic", fake.monotonic)
    monkeypatch.setattr(longpoll, "_sleep", fake.sleep)
    return fake


@pytest.fixture
def claim_calls(monkeypatch):
    calls = []
    real = services.jobs_claim

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(services, "jobs_claim", counting)
    return calls


@pytest.mark.django_db
def test_wait_zero_claims_once(api, clock, fake_time, claim_calls):
    worker = register()
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 0}
    assert api.post("claims", body).json() == {"jobs": []}
    assert len(claim_calls) == 1 and fake_time.sleeps == []


@pytest.mark.django_db
def test_wait_gives_up_after_wait_seconds(api, clock, fake_time, claim_calls, settings):
    settings.APIARY_CLAIM_POLL_INTERVAL = 0.25
    worker = register()
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 3}
    assert api.post("claims", body).json() == {"jobs": []}
    assert sum(fake_time.sleeps) == pytest.approx(3)  # never sleeps past the deadline
    assert all(s <= 0.25 * 1.5 + 1e-9 for s in fake_time.sleeps)  # short, jittered sleeps
    assert len(set(fake_time.sleeps[:-1])) > 1  # not in lockstep
    assert len(claim_calls) == len(fake_time.sleeps) + 1  # a claim after every sleep, and one at the deadline


@pytest.mark.django_db
def test_a_job_enqueued_while_waiting_is_returned(api, clock, fake_time, claim_calls):
    worker = register()
    fake_time.on_sleep = lambda n: enqueue() if n == 3 else None
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 30}
    jobs = api.post("claims", body).json()["jobs"]
    assert len(jobs) == 1
    assert len(fake_time.sleeps) == 3 and len(claim_calls) == 4


@pytest.mark.django_db
def test_a_job_already_queued_is_returned_at_once(api, clock, fake_time):
    enqueue()
    worker = register()
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 30}
    assert len(api.post("claims", body).json()["jobs"]) == 1
    assert fake_time.sleeps == []


@pytest.mark.django_db
def test_errors_end_the_wait_at_once(api, clock, fake_time):
    worker = register()
    register(worker.worker_id)  # a newer process took the id
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 30}
    response = api.post("claims", body)
    assert response.status_code == 409 and response.json()["error"]["code"] == "session_superseded"
    assert fake_time.sleeps == []


@pytest.mark.django_db
def test_a_real_short_wait(api, clock, settings):
    """The un-faked path: real sleeps, a short wait, an empty answer."""
    settings.APIARY_CLAIM_POLL_INTERVAL = 0.02
    worker = register()
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 0.1}
    assert api.post("claims", body).json() == {"jobs": []}


@pytest.mark.django_db(transaction=True)
def test_no_transaction_or_write_lock_is_held_while_waiting(api, clock, fake_time):
    """While the long-poll sleeps, this connection is outside any transaction
    and another connection (another thread) can write — the enqueue it makes
    is what the long-poll then returns."""
    worker = register()
    outcomes = []

    def other_writer():
        try:
            job = enqueue()
            outcomes.append(job.pk)
        except Exception as exc:  # reported below; a held lock shows up as "database is locked"
            outcomes.append(exc)
        finally:
            connection.close()

    def on_sleep(n):
        assert not connection.in_atomic_block
        if n == 2:
            writer = threading.Thread(target=other_writer)
            writer.start()
            writer.join(timeout=60)
            assert not writer.is_alive()

    fake_time.on_sleep = on_sleep
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": 30}
    jobs = api.post("claims", body).json()["jobs"]
    assert len(outcomes) == 1 and isinstance(outcomes[0], int), outcomes
    assert [j["job_id"] for j in jobs] == outcomes
