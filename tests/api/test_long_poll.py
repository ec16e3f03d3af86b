"""Long-poll claims (`wait` > 0): one claim transaction, then a wait that
holds nothing until a wake-up says a job may be claimable; over both the
WSGI view and the listener's ASGI endpoint (the `api` fixture)."""

import threading

import pytest
from django.db import connection

from jobqueue import services
from jobqueue.wakeup import notifier, watch
from tests.factories import enqueue, register
from tests.waiting import wait_for

WAIT = 10.0  # deadline for a thread the test set going; not a timing assertion


@pytest.fixture
def rounds(monkeypatch):
    """Every claim transaction a long-poll runs."""
    calls = []
    real = services.claim_round

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(services, "claim_round", counting)
    return calls


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """No fallback re-check during these tests: every wake is one the test caused."""
    monkeypatch.setattr(notifier, "fallback", 3600.0)
    monkeypatch.setattr(notifier, "_next_fallback", float("inf"))


@pytest.fixture(autouse=True)
def watcher_running():
    """The wake-up watcher's catch-up wake at its start is behind every test."""
    assert watch.ensure_running().wait(WAIT)


def body(worker, wait):
    return {"worker_id": worker.worker_id, "session": worker.session, "wait": wait}


@pytest.mark.django_db
def test_wait_zero_claims_once(api, clock, rounds):
    worker = register()
    assert api.post("claims", body(worker, 0)).json() == {"jobs": []}
    assert len(rounds) == 1


@pytest.mark.django_db
def test_a_job_already_queued_is_returned_at_once(api, clock, rounds):
    enqueue()
    worker = register()
    assert len(api.post("claims", body(worker, 30)).json()["jobs"]) == 1
    assert len(rounds) == 1


@pytest.mark.django_db
def test_errors_end_the_wait_at_once(api, clock, rounds):
    worker = register()
    register(worker.worker_id)  # a newer process took the id
    response = api.post("claims", body(worker, 30))
    assert response.status_code == 409 and response.json()["error"]["code"] == "session_superseded"
    assert len(rounds) == 1


@pytest.mark.django_db
def test_waiting_runs_no_claim_transaction(api, clock, rounds):
    worker = register()
    assert api.post("claims", body(worker, 0.3)).json() == {"jobs": []}
    assert len(rounds) == 1  # the first claim; then only the wait
    assert notifier.waiting() == 0  # and it left no waiter behind


@pytest.mark.django_db
def test_a_worker_that_came_back_empty_skips_the_next_first_claim(
    api, clock, rounds, django_capture_on_commit_callbacks
):
    worker = register()
    for _ in range(3):
        assert api.post("claims", body(worker, 0.1)).json() == {"jobs": []}
    assert len(rounds) == 1  # nothing it could take was announced since its first claim
    with django_capture_on_commit_callbacks(execute=True):  # the test's transaction never commits
        enqueue()
    assert len(api.post("claims", body(worker, 5)).json()["jobs"]) == 1
    assert len(rounds) == 2


@pytest.mark.django_db
def test_a_job_it_cannot_take_does_not_end_its_quiet(api, clock, rounds, django_capture_on_commit_callbacks):
    worker = register()
    assert api.post("claims", body(worker, 0.1)).json() == {"jobs": []}
    with django_capture_on_commit_callbacks(execute=True):
        enqueue(capabilities=("gpu",))  # a class it does not satisfy
    services.claim_round(worker_id=worker.worker_id, session=worker.session)  # the class is known here now
    rounds.clear()
    assert api.post("claims", body(worker, 0.1)).json() == {"jobs": []}
    assert rounds == []


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_while_waiting_is_returned_and_nothing_is_held(api, clock, rounds):
    """While the long-poll waits, no transaction or write lock is held:
    another connection (another thread) enqueues, and that job is the answer."""
    worker = register()
    outcomes = []

    def other_writer():
        try:
            wait_for(lambda: notifier.waiting() == 1, timeout=WAIT, what="the long-poll to wait")
            assert not connection.in_atomic_block
            outcomes.append(enqueue().pk)
        except Exception as exc:  # reported below; a held lock shows up as "database is locked"
            outcomes.append(exc)
        finally:
            connection.close()

    writer = threading.Thread(target=other_writer)
    writer.start()
    jobs = api.post("claims", body(worker, 30)).json()["jobs"]
    writer.join(timeout=WAIT)
    assert len(outcomes) == 1 and isinstance(outcomes[0], int), outcomes
    assert [j["job_id"] for j in jobs] == outcomes
    assert len(rounds) == 2  # the first claim, and one for the wake


@pytest.mark.django_db(transaction=True)
def test_one_enqueue_wakes_one_of_many_waiters(clock, rounds):
    """Five workers long-poll; one job is enqueued: one claim transaction
    follows, not five (no thundering herd), and the oldest waiter gets it."""
    from jobqueue.longpoll import claim_with_wait

    workers = [register(f"w{i}") for i in range(5)]
    got = {}

    def poll(worker):
        try:
            got[worker.worker_id] = claim_with_wait(
                worker_id=worker.worker_id, session=worker.session, max_jobs=1, wait=1.5
            )
        finally:
            connection.close()

    threads = []
    for i, worker in enumerate(workers):
        threads.append(threading.Thread(target=poll, args=(worker,)))
        threads[-1].start()
        wait_for(lambda n=i + 1: notifier.waiting() == n, timeout=WAIT, what=f"{i + 1} waiters")
    rounds.clear()
    enqueue()
    for thread in threads:
        thread.join(timeout=WAIT)
    assert [len(got[w.worker_id]) for w in workers] == [1, 0, 0, 0, 0]
    assert len(rounds) == 1


@pytest.mark.django_db
def test_each_quiet_wait_renews_the_memo(api, clock, rounds, monkeypatch):
    """A memo is trusted for QUIET_FOR seconds from the last time the worker
    waited in line, not from its last claim: an idle fleet re-polling costs
    no transaction however long it stays idle."""
    # Eight waits of 0.1 s outlast QUIET_FOR more than twice, so only renewals keep the memo;
    # the 0.25 s between a wait's end and the next one's check is room for a loaded machine
    # (0.05 s was not: a CI run took 0.34 s between two polls).
    monkeypatch.setattr(notifier, "QUIET_FOR", 0.35)
    worker = register()
    for _ in range(8):
        assert api.post("claims", body(worker, 0.1)).json() == {"jobs": []}
    assert len(rounds) == 1
