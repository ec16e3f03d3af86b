"""`GET /metrics` answers what the queue holds: for a seeded queue, every
gauge and counter has the value the rows say, read at scrape time, and each
heartbeat handled is one observation of the heartbeat histogram."""

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from jobqueue import metrics, services
from jobqueue.exceptions import StaleAttempt
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db

LOOPBACK = {"REMOTE_ADDR": "127.0.0.1"}


def scrape(client: Client | None = None) -> dict[tuple[str, tuple], float]:
    response = (client or Client()).get("/metrics", **LOOPBACK)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_a_seeded_queue_reads_as_its_rows(clock, queue_config):
    queue_config(lease_duration=30, heartbeat_interval=5, worker_timeout=60)
    for _ in range(3):
        enqueue(project="demo")
    enqueue(project="demo", pool="gpu")  # no worker of pool gpu: it stays queued
    enqueue(project="other")
    busy = register("busy", capacity=2)
    register("idle")
    clock.advance(40)
    assert len(claim(busy, max_jobs=2)) == 2
    clock.advance(31)  # both leases ran out: the reaper gives the jobs back
    assert len(services.leases_expire()) == 2
    assert len(claim(busy, max_jobs=1)) == 1
    services.worker_heartbeat(worker_id="busy", session=busy.session)  # idle is silent for 71 s > worker_timeout

    samples = scrape()

    assert value(samples, "apiary_jobs", state="queued", project="demo", pool="") == 2
    assert value(samples, "apiary_jobs", state="leased", project="demo", pool="") == 1
    assert value(samples, "apiary_jobs", state="queued", project="demo", pool="gpu") == 1
    assert value(samples, "apiary_jobs", state="queued", project="other", pool="") == 1
    assert value(samples, "apiary_claims_total") == 3
    assert value(samples, "apiary_lease_expiries_total") == 2
    assert value(samples, "apiary_workers", health="healthy") == 1
    assert value(samples, "apiary_workers", health="stale") == 1
    assert value(samples, "apiary_worker_active_jobs", worker="busy") == 1
    assert value(samples, "apiary_worker_active_jobs", worker="idle") == 0
    assert value(samples, "apiary_queue_oldest_age_seconds") == pytest.approx(71)  # claimable since it was enqueued


def test_a_scrape_reads_the_database_each_time(clock):
    """Nothing is cached in the process that answers: a job enqueued between two scrapes shows in the second."""
    assert ("apiary_jobs", (("pool", ""), ("project", "demo"), ("state", "queued"))) not in scrape()
    enqueue(project="demo")
    assert value(scrape(), "apiary_jobs", state="queued", project="demo", pool="") == 1


def test_live_attempts_count_per_worker_and_an_empty_queue_is_zero_old(clock):
    assert value(scrape(), "apiary_queue_oldest_age_seconds") == 0
    worker = register("w1", capacity=2)
    enqueue()
    enqueue()
    claim(worker, max_jobs=2)
    samples = scrape()
    assert value(samples, "apiary_worker_active_jobs", worker="w1") == 2
    assert value(samples, "apiary_workers", health="healthy") == 1
    assert value(samples, "apiary_queue_oldest_age_seconds") == 0  # nothing queued


def test_each_heartbeat_handled_is_one_observation_of_the_histogram(clock):
    worker = register("w1")
    enqueue()
    (job,) = claim(worker)
    before = scrape()
    count = value(before, "apiary_attempt_heartbeat_seconds_count")
    services.attempt_heartbeat(attempt_id=job.attempt_id, token=job.token)
    services.attempt_heartbeat_with_checkpoint(attempt_id=job.attempt_id, token=job.token, step="s", content="c")
    with pytest.raises(StaleAttempt):
        services.attempt_heartbeat(attempt_id=job.attempt_id, token="not-the-token")  # refused: handled all the same
    after = scrape()
    assert value(after, "apiary_attempt_heartbeat_seconds_count") == count + 3
    assert value(after, "apiary_attempt_heartbeat_seconds_bucket", le="+Inf") == count + 3


def test_every_name_listed_as_exported_is_in_a_scrape(clock):
    """examples/monitoring is checked against metrics.EXPORTED: the list must be what a scrape has."""
    register("w1")
    enqueue()
    names = {name for name, _ in scrape()}
    assert set(metrics.EXPORTED) <= names


def test_every_state_reads_zero_rather_than_absent_and_exited_and_forgotten_workers_count_right(clock, queue_config):
    """A queue growing from empty needs `queued 0` an hour ago for the alert's comparison; a worker
    that drained and said goodbye is `exited` (no 500); a forgotten one is no longer counted."""
    queue_config(worker_timeout=60)
    enqueue(project="demo")
    leaving = register("leaving")
    services.worker_drain(worker_id="leaving")
    services.worker_heartbeat(worker_id="leaving", session=leaving.session, draining=True, ready=False)
    register("gone")
    clock.advance(61)
    services.worker_forget(worker_id="gone")

    samples = scrape()
    assert value(samples, "apiary_jobs", state="queued", project="demo", pool="") == 1
    assert value(samples, "apiary_jobs", state="failed", project="demo", pool="") == 0
    assert value(samples, "apiary_workers", health="exited") == 1
    assert value(samples, "apiary_workers", health="stale") == 0
    assert ("apiary_worker_active_jobs", (("worker", "gone"),)) not in samples
