"""Races between two transactions under PostgreSQL's READ COMMITTED, each
staged deterministically: one thread is stopped inside a service while the
other runs. Found in review; each test failed before its fix."""

import pytest
from django.db import connection, transaction

from jobqueue import services
from jobqueue.conf import Limits
from jobqueue.models import Attempt, Job, JobEvent
from jobqueue.services import attempts, claiming, jobs
from jobqueue.services import workers as worker_services
from tests.factories import claim, enqueue, enqueue_job, make_task, register
from tests.queue.racing import WAIT, lock_waiters, pause_in, run_thread
from tests.waiting import wait_for
from workflows.config import load
from workflows.services import dispatch

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _pg():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only")


def test_requirement_set_committed_out_of_id_order_is_never_claimable(clock, monkeypatch):
    """Set N commits after set N+1 was cached: a worker that matches only set N
    got [] forever: the requirement cache only asked for ids above the highest seen."""
    slow_task, fast_task = make_task(), make_task()
    paused, release = pause_in(monkeypatch, jobs, "emit", "slow")
    t, out = run_thread(lambda: enqueue_job(slow_task, workflow="triage", agent="a", runner="shell",
                                                     project="p", labels=["gpu"]), "slow")
    # set N inserted, not committed
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    enqueue(fast_task, labels=["cpu"])           # set N+1, committed
    other = register("cpu-worker", labels=["cpu"])
    assert len(claim(other)) == 1                # cache: last_id = N+1
    release.set()
    t.join(20)
    gpu_job, _ = out["value"]
    gpu = register("gpu-worker", labels=["gpu"])
    for _ in range(5):
        got = claim(gpu)
        if got:
            break
    assert [c.job_id for c in got] == [gpu_job.pk]


def test_concurrent_claims_of_one_worker_exceed_its_capacity(clock, monkeypatch):
    """The busy count was a sub-select of the `FOR UPDATE OF w` statement,
    computed from the snapshot taken before waiting for the worker row lock."""
    enqueue()
    enqueue()
    w = register("w1", capacity=1)
    paused, release = pause_in(monkeypatch, claiming, "_lease", "first", after=True)
    t1, out1 = run_thread(lambda: claim(w), "first")
    # first claim leased 1 job, holds the worker row
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: claim(w), "second")
    # second claim waits on the worker row
    wait_for(lambda: lock_waiters() > before, timeout=WAIT, what="the second thread to wait on a lock")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    active = Attempt.objects.filter(worker_id="w1", state="active").count()
    assert active <= 1, f"capacity 1, {active} active attempts ({len(out1['value'])} + {len(out2['value'])})"


def test_a_claim_takes_the_next_jobs_when_another_claim_holds_the_best_ones_locked(clock, monkeypatch):
    """The candidates of a claim are the best few queued jobs, locked SKIP LOCKED. With
    another claim holding all of them, it came back empty and starved (its long-poll then
    slept, and a benchmark's claimer quit) while the queue still held jobs it could take."""
    jobs_queued = [enqueue() for _ in range(20)]
    first, second = register("first", capacity=12), register("second", capacity=4)
    paused, release = pause_in(monkeypatch, claiming, "_lease", "first")
    t, out = run_thread(lambda: claim(first, 12), "first")  # its 12 candidates locked, not leased yet
    wait_for(paused.is_set, timeout=WAIT, what="the first claim to lock its candidates")
    got = services.claim_round(worker_id=second.worker_id, session=second.session, max_jobs=4)
    release.set()
    t.join(20)
    ids = [job.pk for job in jobs_queued]
    assert [c.job_id for c in got.claims] == ids[12:16]  # the best ones the first claim does not hold
    assert not got.starved
    assert sorted(c.job_id for c in out["value"]) == ids[:12]


def test_a_cancel_racing_finishes_settled_together_waits_and_cannot_undo_them(clock, monkeypatch):
    """Finishes settled together (attempt_finish's `many`) read their attempts and jobs locked,
    then settle them: a cancel of one of those jobs meanwhile waits for that commit and finds
    it succeeded. Without the lock the cancel would request a cancel of a job that then reads
    as succeeded, or the settling would miss the request it should have lost to."""
    enqueue(), enqueue()
    claims = claim(register("w1", capacity=2), 2)
    calls = [{"attempt_id": c.attempt_id, "token": c.token, "outcome": "succeeded"} for c in claims]
    paused, release = pause_in(monkeypatch, attempts, "attempts_succeed", "finisher")

    def settle():
        with transaction.atomic(durable=True):
            return services.attempt_finish.body.many(calls)

    t1, out1 = run_thread(settle, "finisher")
    wait_for(paused.is_set, timeout=WAIT, what="the finishes to hold their rows")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: services.job_cancel(job_id=claims[0].job_id), "canceller")
    wait_for(lambda: lock_waiters() > before, timeout=WAIT, what="the cancel to wait for the finishes' locks")
    release.set()
    t1.join(20)
    t2.join(20)
    assert out1.get("value") == [("succeeded", None)] * 2, out1
    assert out2["value"].state == "succeeded" and out2["value"].cancel_requested_at is None, out2
    assert set(Job.objects.values_list("state", flat=True)) == {"succeeded"}
    assert not JobEvent.objects.filter(kind__startswith="cancel").exists()


def test_reconcile_racing_worker_register_crashes(clock, monkeypatch):
    """reconcile() read attempts without locking; a re-registration that
    expired the same attempt first made reconcile's guarded update hit 0 rows."""
    enqueue()
    w = register("w1")
    [c] = claim(w)
    clock.advance(31)                            # lease ran out: reconcile will expire it
    paused, release = pause_in(monkeypatch, worker_services, "expire", "register")
    t1, out1 = run_thread(lambda: register("w1"), "register")
    # register holds attempt + job row locks
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: services.reconcile(), "reconcile")
    # reconcile skips rows others hold
    wait_for(lambda: lock_waiters() > before or not t2.is_alive(), timeout=WAIT,
             what="the second thread to wait on a lock or to end")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1, out1
    assert "error" not in out2, repr(out2["error"])


def test_reconcile_loses_a_cancel_recorded_while_it_runs(clock, monkeypatch):
    """reconcile() expired from an unlocked read of the job: a cancel committed
    in between was overwritten by leased -> queued, the job could no longer be
    cancelled (its cancel was already recorded) and it ran again. Now the
    cancel waits for reconcile's row lock and then cancels the requeued job."""
    job = enqueue()
    w = register("w1")
    claim(w)
    clock.advance(31)
    paused, release = pause_in(monkeypatch, attempts, "expire", "reconcile")
    t1, out1 = run_thread(lambda: services.reconcile(), "reconcile")
    # reconcile holds the attempt and job rows
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: services.job_cancel(job_id=job.pk), "cancel")
    wait_for(lambda: lock_waiters() > before or not t2.is_alive(), timeout=WAIT,
             what="the second thread to wait on a lock or to end")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    job.refresh_from_db()
    assert job.state == "cancelled", (job.state, job.cancel_requested_at)
    assert claim(register("w2")) == []


def test_enqueue_dedup_race(clock, monkeypatch):
    paused, release = pause_in(monkeypatch, jobs, "emit", "slow")
    kw = dict(key="1:1:triage", payload={}, agent="a", runner="shell", project="p", source="inbox")
    t1, out1 = run_thread(lambda: services.job_enqueue(**kw), "slow")
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: services.job_enqueue(**kw), "fast")
    wait_for(lambda: lock_waiters() > before, timeout=WAIT, what="the second thread to wait on a lock")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert out1["value"][1] is True and out2["value"][1] is False and out1["value"][0].pk == out2["value"][0].pk
    assert Job.objects.count() == 1


def test_affinity_pin_race(clock, monkeypatch):
    task = make_task()
    enqueue(task, workflow="a", affinity=True)
    enqueue(task, workflow="b", affinity=True)
    wa, wb = register("wa"), register("wb")
    paused, release = pause_in(monkeypatch, claiming, "pin", "A", after=True)
    t1, out1 = run_thread(lambda: claim(wa), "A")
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: claim(wb), "B")
    wait_for(lambda: lock_waiters() > before or not t2.is_alive(), timeout=WAIT,
             what="the second thread to wait on a lock or to end")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert len(out1["value"]) == 1 and out2["value"] == [], (out1, out2)
    assert set(Attempt.objects.values_list("worker_id", flat=True)) == {"wa"}


def test_project_limit_race(clock, monkeypatch, queue_config):
    queue_config(limits=Limits(overrides={"project": {"demo": 1}}))
    enqueue()
    enqueue(labels=["x"])
    wa, wb = register("wa"), register("wb", labels=["x"])
    paused, release = pause_in(monkeypatch, claiming, "_lease", "A", after=True)
    t1, out1 = run_thread(lambda: claim(wa), "A")
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    t2, out2 = run_thread(lambda: claim(wb), "B")
    t2.join(5)
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert claim(wb) == []
    assert Attempt.objects.filter(state="active").count() == 1


DISPATCH_CONFIG = """
project: p
agents:
  - id: a
    runner: shell
    command: cat
sources:
  - id: inbox
    type: directory
    path: inbox
    workflows: [triage]
workflows:
  - id: triage
    agent: a
    steps:
      - id: s
        run: "true"
"""


def test_dispatch_race(clock, monkeypatch, tmp_path):
    """Two dispatches of one task: the second waited on the instance's unique
    index, then raised IntegrityError instead of returning the existing job."""
    (tmp_path / "apiary.yaml").write_text(DISPATCH_CONFIG)
    (tmp_path / "inbox").mkdir()
    config = load(tmp_path / "apiary.yaml")
    task = make_task(source="inbox")
    paused, release = pause_in(monkeypatch, jobs, "emit", "slow")
    t1, out1 = run_thread(lambda: dispatch(config=config, task=task, workflows=("triage",)), "slow")
    wait_for(paused.is_set, timeout=WAIT, what="the first dispatch to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: dispatch(config=config, task=task, workflows=("triage",)), "fast")
    wait_for(lambda: lock_waiters() > before, timeout=WAIT, what="the second dispatch to wait on a lock")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert [len(out1["value"]), len(out2["value"])] == [1, 0]  # jobs created: by the first only
    assert Job.objects.count() == 1


def test_two_enrolments_of_one_new_worker_id_at_once_admit_one(clock, monkeypatch):
    """Both read "no credential, no live session" before either wrote: both were
    admitted, each with a credential for the same id. The id's advisory lock
    makes the second wait, then see the first's credential."""
    from jobqueue.exceptions import CredentialRequired
    from jobqueue.models import WorkerCredential
    from jobqueue.services import credentials

    paused, release = pause_in(monkeypatch, credentials, "_new", "first")
    first, out1 = run_thread(lambda: services.worker_enroll(worker_id="twin", capacity=1), "first")
    wait_for(paused.is_set, timeout=WAIT, what="the first enrolment to pause before its credential")
    second, out2 = run_thread(lambda: services.worker_enroll(worker_id="twin", capacity=1), "second")
    wait_for(lambda: lock_waiters() >= 1, timeout=WAIT, what="the second enrolment to wait for the id's lock")
    release.set()
    first.join(20)
    second.join(20)
    assert "error" not in out1, out1
    assert isinstance(out2.get("error"), CredentialRequired), out2
    assert WorkerCredential.objects.filter(worker_id="twin").count() == 1


def test_two_finishes_that_claim_for_one_worker_at_once_stay_within_its_capacity(clock, monkeypatch):
    """attempt_finish_and_claim in two transactions at once (two group commits of one worker
    id): the second claim recounts the worker's live attempts under the worker row's lock,
    after the first committed, so the two never lease past the capacity."""
    for _ in range(4):
        enqueue()
    w = register("w1", capacity=2)
    c1, c2 = claim(w, max_jobs=2)

    def finish(c):
        return services.attempt_finish_and_claim(
            attempt_id=c.attempt_id, token=c.token, outcome="succeeded", worker_id="w1", session=w.session, max_jobs=2
        )

    paused, release = pause_in(monkeypatch, claiming, "_lease", "first", after=True)
    t1, out1 = run_thread(lambda: finish(c1), "first")
    # the first finished its attempt and leased up to the slot it freed, holding the worker row
    wait_for(paused.is_set, timeout=WAIT, what="the first thread to pause")
    before = lock_waiters()
    t2, out2 = run_thread(lambda: finish(c2), "second")
    wait_for(lambda: lock_waiters() > before, timeout=WAIT, what="the second thread to wait on a lock")
    release.set()
    t1.join(20)
    t2.join(20)
    assert "error" not in out1 and "error" not in out2, (out1, out2)
    assert Job.objects.filter(pk__in=[c1.job_id, c2.job_id], state="succeeded").count() == 2
    active = Attempt.objects.filter(worker_id="w1", state="active").count()
    claimed = len(out1["value"].claims) + len(out2["value"].claims)
    assert active == claimed == 2, f"capacity 2: {active} active, {claimed} claimed"
