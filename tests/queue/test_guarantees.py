"""One test (or a few) per queue guarantee of DESIGN §3.3, against jobqueue.services.

Time only moves through the injected clock (`clock.advance`); nothing sleeps.
The tests use nothing backend-specific, so the same file runs on SQLite and on
PostgreSQL (`APIARY_TEST_DB=postgres`).
"""

import datetime as dt
import hashlib
import math
import string
import threading

import pytest
from django.db import connection, transaction

from jobqueue import services
from jobqueue.conf import Limits
from jobqueue.exceptions import NotFound, SessionSuperseded, StaleAttempt, Unavailable
from jobqueue.models import Affinity, Attempt, AttemptState, Job, JobEvent, JobState
from jobqueue.services import jobs
from jobqueue.services.attempts import _backoff
from jobqueue.types import Retry
from tests.factories import (
    claim,
    enqueue,
    enqueue_job,
    instance_state,
    make_task,
    register,
    snapshot,
    task_state_of,
)
from workflows.models import Task, WorkflowInstance
from workflows.services import affinity_key

pytestmark = pytest.mark.django_db

LEASE = 30.0  # QueueConfig's default lease_duration


def heartbeat(c, token=None):
    return services.attempt_heartbeat(attempt_id=c.attempt_id, token=token or c.token)


def finish(c, outcome="succeeded", token=None, **kwargs):
    return services.attempt_finish(attempt_id=c.attempt_id, token=token or c.token, outcome=outcome, **kwargs)


def job_state(job_id) -> str:
    return Job.objects.get(pk=job_id).state


def events(job_id) -> list[str]:
    return list(JobEvent.objects.filter(job_id=job_id).values_list("kind", flat=True))


def in_other_connection(fn):
    """Run `fn` in a thread, hence on its own database connection; returns its
    result or the exception it raised."""
    out = []

    def run():
        from django.db import connection as own

        try:
            out.append(fn())
        except Exception as exc:  # handed back to the test to judge
            out.append(exc)
        finally:
            own.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert out, "the other connection did not answer"
    return out[0]


# --------------------------------------------------------------------------- durable before runnable


@pytest.mark.django_db(transaction=True)
def test_enqueued_job_is_invisible_to_claims_until_enqueue_has_committed(clock, monkeypatch):
    worker = register("w1")
    during = []
    announce = jobs.emit
    if connection.vendor == "sqlite":  # the other connection gives up on the write lock in 1 s, not the 30 s busy timeout
        monkeypatch.setitem(connection.settings_dict["OPTIONS"], "timeout", 1.0)

    def claim_while_enqueue_is_open(cursor, wake):
        # Runs inside job_enqueue's transaction, after the job row (and its event) was written.
        announce(cursor, wake)
        during.append(in_other_connection(lambda: claim(worker)))

    monkeypatch.setattr(jobs, "emit", claim_while_enqueue_is_open)
    job = enqueue()

    # Another connection either saw no job (PostgreSQL: uncommitted rows are
    # invisible) or could not even start its claim transaction (SQLite: the
    # enqueue holds the write lock). Either way nobody could run the job yet.
    [seen] = during
    assert seen == [] or isinstance(seen, Unavailable), seen
    assert not connection.in_atomic_block  # enqueue returned: its transaction is over
    claimed = in_other_connection(lambda: claim(worker))
    assert [c.job_id for c in claimed] == [job.pk]


def test_enqueue_that_fails_midway_leaves_nothing_claimable(clock, monkeypatch):
    worker = register("w1")
    task = make_task()
    announce = jobs.emit

    def crash(cursor, wake):
        announce(cursor, wake)
        raise RuntimeError("crash after the job row was written")

    monkeypatch.setattr(jobs, "emit", crash)
    before = snapshot()
    with pytest.raises(RuntimeError, match="crash after"):
        enqueue_job(task, workflow="triage", agent="engineer", runner="shell", project="demo")
    monkeypatch.undo()
    assert snapshot() == before
    assert claim(worker) == []


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda task, w: services.job_enqueue(key="x", payload={}, agent="a", runner="shell", project="p", source="s"),
            id="job_enqueue",
        ),
        pytest.param(lambda task, w: claim(w), id="jobs_claim"),
        pytest.param(lambda task, w: services.leases_expire(), id="leases_expire"),
        pytest.param(lambda task, w: services.worker_register(worker_id="w2"), id="worker_register"),
        pytest.param(lambda task, w: services.reconcile(), id="reconcile"),
    ],
)
def test_services_refuse_to_run_inside_a_callers_transaction(clock, call):
    # A service nested in an outer transaction could be rolled back after it
    # "returned": a job the caller believed durable would vanish. They refuse.
    task, worker = make_task(), register("w1")
    enqueue()
    before = snapshot()
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        call(task, worker)
    assert snapshot() == before


# --------------------------------------------------------------------------- dedup


def test_enqueue_same_key_returns_existing_job_and_creates_nothing(clock):
    task = make_task()
    job, created = enqueue_job(task, workflow="triage", agent="engineer", runner="shell", project="demo")
    before = snapshot()
    clock.advance(5)
    again, created_again = services.job_enqueue(
        key=job.key, payload={"other": 1}, agent="deployer", runner="codex-cli", project="other", source="s", priority=9
    )
    assert created and not created_again
    assert again.pk == job.pk
    assert snapshot() == before  # no job, no instance, no event, nothing touched
    assert (Job.objects.count(), WorkflowInstance.objects.count(), JobEvent.objects.count()) == (1, 1, 1)


def test_enqueue_key_is_task_generation_and_workflow(clock):
    task = make_task()
    first = enqueue(task, workflow="triage")
    other_workflow = enqueue(task, workflow="fix")
    Task.objects.filter(pk=task.pk).update(generation=2)  # the item changed: a new generation
    task.refresh_from_db()
    next_generation = enqueue(task, workflow="triage")
    assert len({first.pk, other_workflow.pk, next_generation.pk}) == 3
    assert {first.key, other_workflow.key, next_generation.key} == {
        f"{task.pk}:1:triage",
        f"{task.pk}:1:fix",
        f"{task.pk}:2:triage",
    }


# --------------------------------------------------------------------------- claim eligibility


def test_job_with_a_pool_goes_only_to_a_worker_of_that_pool(clock):
    job = enqueue(pool="build")
    assert claim(register("no-pool")) == []
    assert claim(register("other-pool", pool="deploy")) == []
    assert [c.job_id for c in claim(register("builder", pool="build"))] == [job.pk]


def test_job_without_a_pool_is_open_to_any_pool(clock):
    job = enqueue(pool=None)
    assert [c.job_id for c in claim(register("w1", pool="gpu"))] == [job.pk]


def test_worker_needs_every_required_label(clock):
    job = enqueue(labels=["linux", "gpu"])
    assert claim(register("linux-only", labels=["linux"])) == []
    assert [c.job_id for c in claim(register("w2", labels=["gpu", "linux", "arm"]))] == [job.pk]


@pytest.mark.parametrize(
    "capabilities, can_claim",
    [
        (["apiary.workflow", "runner:codex-cli"], False),  # lacks the job's own requirement
        (["apiary.workflow", "docker"], False),  # lacks runner:<adapter>
        (["runner:codex-cli", "docker"], False),  # lacks apiary.workflow
        (["apiary.workflow", "runner:codex-cli", "docker", "extra"], True),
    ],
)
def test_worker_needs_every_capability_including_apiary_workflow_and_its_runner(clock, capabilities, can_claim):
    job = enqueue(runner="codex-cli", capabilities=["docker"])
    worker = services.worker_register(worker_id="w1", capabilities=capabilities)
    assert [c.job_id for c in claim(worker)] == ([job.pk] if can_claim else [])


def test_affinity_pins_task_to_first_claimer_until_released(clock):
    task = make_task()
    first = enqueue(task, workflow="plan", affinity=True)
    clock.advance(1)
    second = enqueue(task, workflow="build", affinity=True)
    w1, w2 = register("w1", capacity=5), register("w2", capacity=5)

    assert [c.job_id for c in claim(w1)] == [first.pk]
    assert Affinity.objects.get(key=affinity_key(task.pk)).worker_id == "w1"
    assert claim(w2, 5) == []  # the task's later job waits for w1

    assert [c.job_id for c in claim(w1, 5)] == [second.pk]

    third = enqueue(task, workflow="review", affinity=True)
    assert claim(w2, 5) == []
    assert services.affinity_release(key=affinity_key(task.pk)) is True
    assert [c.job_id for c in claim(w2, 5)] == [third.pk]
    assert Affinity.objects.get(key=affinity_key(task.pk)).worker_id == "w2"  # w2's claim pinned it anew


def test_affinity_pin_outlives_the_claimers_attempt(clock):
    task = make_task()
    first = enqueue(task, workflow="plan", affinity=True)
    w1, w2 = register("w1"), register("w2")
    [c] = claim(w1)
    assert finish(c) == JobState.SUCCEEDED
    later = enqueue(task, workflow="build", affinity=True)
    assert claim(w2) == []
    assert [c.job_id for c in claim(w1)] == [later.pk]
    assert first.pk != later.pk


def test_affinity_release_of_an_unpinned_task_is_false(clock):
    assert services.affinity_release(key=affinity_key(make_task().pk)) is False


# Limits. Each dimension gets two keys X and Y with two jobs each. A case is
# (the dimension's default or None for absent, keyed overrides, how many jobs
# of each key may be leased at once).
LIMIT_CASES = {
    "default": (1, {}, {"X": 1, "Y": 1}),
    "override": (None, {"X": 1}, {"X": 1, "Y": 2}),
    "override_zero_is_unlimited": (1, {"X": 0}, {"X": 2, "Y": 1}),
    "override_beats_default": (1, {"Y": 2}, {"X": 1, "Y": 2}),
    "default_zero_is_unlimited": (0, {}, {"X": 2, "Y": 2}),
    "absent_is_unlimited": (None, {}, {"X": 2, "Y": 2}),
}


def _limits(dimension: str, default: int | None, overrides: dict[str, int]) -> Limits:
    return Limits(
        defaults={} if default is None else {dimension: default},
        overrides={dimension: {f"{dimension}-{k}": n for k, n in overrides.items()}} if overrides else {},
    )


def _job_with_key(dimension: str, key: str, **kwargs) -> Job:
    """A job whose limit key in `dimension` is `key`, claimable by `_worker_for`."""
    fields = {"project": "demo", "agent": "engineer", "runner": "shell", "pool": None, "source": "inbox"}
    fields[dimension] = f"{dimension}-{key}"
    task = make_task(source=fields.pop("source"))
    return enqueue(task, **fields, **kwargs)


def _workers_for(dimension: str) -> list:
    runners = ("shell", "runner-X", "runner-Y")
    if dimension == "pool":  # a job with a pool goes only to that pool's workers
        return [register(f"w-{k}", pool=f"pool-{k}", runners=runners, capacity=10) for k in "XY"]
    return [register("w", runners=runners, capacity=10)]


@pytest.mark.parametrize("dimension", ["project", "source", "agent", "runner", "pool"])
@pytest.mark.parametrize("case", list(LIMIT_CASES))
def test_limits_per_dimension_with_defaults_and_keyed_overrides(clock, queue_config, dimension, case):
    default, overrides, allowed = LIMIT_CASES[case]
    queue_config(limits=_limits(dimension, default, overrides))
    jobs = {key: [_job_with_key(dimension, key) for _ in range(2)] for key in "XY"}
    leased = {key: 0 for key in "XY"}
    for worker in _workers_for(dimension):
        for c in claim(worker, 10):
            leased[next(k for k, js in jobs.items() if c.job_id in {j.pk for j in js})] += 1
    assert leased == allowed


def test_limit_slot_is_freed_by_finish(clock, queue_config):
    queue_config(limits=Limits(defaults={"agent": 1}))
    first, second = enqueue(agent="deployer"), enqueue(agent="deployer")
    worker = register("w1", capacity=5)
    [c] = claim(worker, 5)
    assert c.job_id == first.pk
    assert claim(worker, 5) == []
    finish(c)
    assert [c.job_id for c in claim(worker, 5)] == [second.pk]


def test_limit_counts_only_live_attempts_not_expired_unreaped_ones(clock, queue_config):
    queue_config(limits=Limits(overrides={"pool": {"production": 1}}))
    first, second = enqueue(pool="production"), enqueue(pool="production")
    w1, w2 = register("w1", pool="production"), register("w2", pool="production")
    [c] = claim(w1)
    assert c.job_id == first.pk
    assert claim(w2) == []
    clock.advance(LEASE + 1)  # the lease ran out; nobody has reaped it yet
    assert Attempt.objects.get(pk=c.attempt_id).state == AttemptState.ACTIVE
    assert [c.job_id for c in claim(w2)] == [second.pk]


def test_heartbeat_keeps_a_limit_slot_held(clock, queue_config):
    queue_config(limits=Limits(defaults={"project": 1}))
    enqueue(project="p"), enqueue(project="p")
    w1, w2 = register("w1"), register("w2")
    [c] = claim(w1)
    clock.advance(LEASE - 1)
    heartbeat(c)
    clock.advance(LEASE - 1)  # past the first lease, inside the extended one
    assert claim(w2) == []


def test_saturated_pool_limit_does_not_block_jobs_without_a_pool(clock, queue_config):
    # A job without a pool has no pool limit key; a full pool must not hide it.
    queue_config(limits=Limits(overrides={"pool": {"build": 1}}))
    enqueue(pool="build")
    claim(register("builder", pool="build"))  # takes the build pool's only slot
    anywhere = enqueue(pool=None)
    assert [c.job_id for c in claim(register("plain"))] == [anywhere.pk]
    elsewhere = enqueue(pool=None)
    assert [c.job_id for c in claim(register("builder-2", pool="build"))] == [elsewhere.pk]


def test_a_full_pool_limit_does_not_hide_jobs_without_a_pool(clock, queue_config):
    # Found by the stateful test on PostgreSQL: the claim excluded saturated keys
    # with `pool NOT IN (…)`, which is never true for a job whose pool is NULL.
    queue_config(limits=Limits(overrides={"pool": {"build": 1}}))
    builds = [enqueue(pool="build") for _ in range(3)]
    anywhere = enqueue()
    worker = register("w1", pool="build", capacity=4)
    claimed = {c.job_id for c in claim(worker, max_jobs=3)}
    assert claimed == {builds[0].pk, anywhere.pk}


def test_claim_never_exceeds_free_capacity(clock):
    jobs = [enqueue() for _ in range(5)]
    worker = register("w1", capacity=3)
    first = claim(worker, max_jobs=2)
    assert [c.job_id for c in first] == [j.pk for j in jobs[:2]]
    assert [c.job_id for c in claim(worker, max_jobs=5)] == [jobs[2].pk]  # only one slot left
    assert claim(worker, max_jobs=5) == []
    finish(first[0])
    assert len(claim(worker, max_jobs=5)) == 1


@pytest.mark.parametrize(
    "make_unavailable",
    [
        pytest.param(
            lambda w: services.worker_heartbeat(worker_id="w1", session=w.session, draining=True), id="draining"
        ),
        pytest.param(
            lambda w: services.worker_heartbeat(worker_id="w1", session=w.session, ready=False), id="not-ready"
        ),
        pytest.param(lambda w: services.worker_drain(worker_id="w1"), id="drain-requested"),
    ],
)
def test_draining_unready_or_drain_requested_worker_gets_nothing(clock, make_unavailable):
    job = enqueue()
    worker = register("w1")
    make_unavailable(worker)
    assert claim(worker) == []
    assert job_state(job.pk) == JobState.QUEUED


def test_undrain_lets_the_worker_claim_again(clock):
    job = enqueue()
    worker = register("w1")
    services.worker_drain(worker_id="w1")
    assert claim(worker) == []
    services.worker_undrain(worker_id="w1")
    assert [c.job_id for c in claim(worker)] == [job.pk]


def test_claim_order_is_priority_then_age(clock):
    low = enqueue(priority=-1)
    clock.advance(1)
    old = enqueue()
    clock.advance(1)
    new = enqueue()
    clock.advance(1)
    high = enqueue(priority=5)
    worker = register("w1", capacity=10)
    assert [claim(worker)[0].job_id for _ in range(4)] == [high.pk, old.pk, new.pk, low.pk]


def test_claim_of_several_returns_them_best_first(clock):
    low = enqueue(priority=0)
    clock.advance(1)
    high = enqueue(priority=3)
    assert [c.job_id for c in claim(register("w1", capacity=5), 5)] == [high.pk, low.pk]


def test_claim_order_holds_across_jobs_with_different_requirements(clock):
    # Jobs with different requirements are found by separate walks; the
    # order must still be one global priority-then-age order.
    old_plain = enqueue(priority=1)
    clock.advance(1)
    new_linux = enqueue(priority=1, labels=["linux"])
    clock.advance(1)
    urgent_pooled = enqueue(priority=7, pool="build")
    clock.advance(1)
    low_docker = enqueue(priority=0, capabilities=["docker"])
    clock.advance(1)
    mid_plain = enqueue(priority=4)
    worker = register("w1", pool="build", labels=["linux"], capabilities=["docker"], capacity=10)
    expected = [urgent_pooled.pk, mid_plain.pk, old_plain.pk, new_linux.pk, low_docker.pk]
    assert [claim(worker)[0].job_id for _ in range(5)] == expected


def test_claim_of_several_across_requirements_is_best_first(clock):
    a = enqueue(priority=2, labels=["linux"])
    b = enqueue(priority=5)
    c = enqueue(priority=3, labels=["linux"])
    worker = register("w1", labels=["linux"], capacity=10)
    assert [x.job_id for x in claim(worker, 10)] == [b.pk, c.pk, a.pk]


def test_job_is_not_claimable_before_available_at(clock):
    job = enqueue(retry=Retry(max_attempts=2, backoff=10))
    worker = register("w1")
    [c] = claim(worker)
    finish(c, "failed")  # retry after 5..10 s
    available_at = Job.objects.get(pk=job.pk).available_at
    assert available_at > clock.now()
    clock.advance((available_at - clock.now()).total_seconds() - 0.001)
    assert claim(worker) == []
    clock.advance(0.001)
    assert [c.job_id for c in claim(worker)] == [job.pk]


def test_claim_from_an_unknown_worker_is_not_found(clock):
    with pytest.raises(NotFound):
        services.jobs_claim(worker_id="ghost", session="x")


# --------------------------------------------------------------------------- token


def _bits(token: str) -> float:
    alphabets = [string.hexdigits.lower(), string.ascii_letters + string.digits + "-_"]
    alphabet = next(a for a in alphabets if set(token) <= set(a))
    return len(token) * math.log2(len(alphabet))


def test_token_is_long_random_and_only_its_sha256_is_stored(clock):
    for _ in range(3):
        enqueue()
    claims = claim(register("w1", capacity=3), 3)
    tokens = [c.token for c in claims]
    assert len(set(tokens)) == 3
    for c in claims:
        assert _bits(c.token) >= 128
        attempt = Attempt.objects.get(pk=c.attempt_id)
        assert attempt.token_hash == hashlib.sha256(c.token.encode()).hexdigest()
        stored = list(Attempt.objects.values_list()) + list(JobEvent.objects.values_list())
        assert not any(c.token in str(value) for row in stored for value in row)


def test_claim_sets_lease_from_the_injected_clock(clock, queue_config):
    queue_config(lease_duration=12)
    enqueue()
    [c] = claim(register("w1"))
    assert c.lease_expires_at == clock.now() + dt.timedelta(seconds=12)
    assert Attempt.objects.get(pk=c.attempt_id).lease_expires_at == c.lease_expires_at
    assert job_state(c.job_id) == JobState.LEASED


# --------------------------------------------------------------------------- fencing


def _assert_stale_and_unchanged(*calls):
    before = snapshot()
    for call in calls:
        with pytest.raises(StaleAttempt):
            call()
    assert snapshot() == before


def test_wrong_token_is_stale_and_changes_nothing(clock):
    enqueue(), enqueue()
    a, b = claim(register("w1", capacity=2), 2)
    _assert_stale_and_unchanged(
        lambda: heartbeat(a, token="not-the-token"),
        lambda: heartbeat(a, token=b.token),  # another attempt's valid token
        lambda: finish(a, "succeeded", token=b.token),
        lambda: finish(a, "failed", token=a.token[:-1]),
    )
    assert heartbeat(a).cancel is False  # the right token still works


def test_expired_lease_is_stale_before_it_is_reaped(clock):
    enqueue()
    [c] = claim(register("w1"))
    clock.advance(LEASE + 0.5)
    _assert_stale_and_unchanged(lambda: heartbeat(c), lambda: finish(c, "succeeded"), lambda: finish(c, "failed"))


def test_old_token_is_stale_after_expiry_and_reclaim(clock):
    job = enqueue()
    [old] = claim(register("w1"))
    clock.advance(LEASE + 1)
    services.leases_expire()
    [new] = claim(register("w2"))
    assert new.job_id == job.pk and new.attempt_number == 2
    _assert_stale_and_unchanged(
        lambda: heartbeat(old),
        lambda: finish(old, "succeeded"),
        lambda: finish(old, "cancelled"),
        lambda: services.attempt_finish(attempt_id=new.attempt_id, token=old.token, outcome="succeeded"),
    )
    assert finish(new) == JobState.SUCCEEDED


def test_heartbeat_extends_the_lease(clock):
    enqueue()
    [c] = claim(register("w1"))
    clock.advance(LEASE - 1)
    hb = heartbeat(c)
    assert hb.lease_expires_at == clock.now() + dt.timedelta(seconds=LEASE)
    clock.advance(LEASE - 1)  # beyond the first lease
    assert finish(c) == JobState.SUCCEEDED


def test_unknown_attempt_is_not_found(clock):
    with pytest.raises(NotFound):
        services.attempt_heartbeat(attempt_id=999_999, token="x")


@pytest.mark.parametrize(
    "outcome, retry, expected",
    [
        ("succeeded", None, JobState.SUCCEEDED),
        ("failed", None, JobState.FAILED),
        ("cancelled", None, JobState.CANCELLED),
        ("failed", Retry(max_attempts=2, backoff=10), JobState.QUEUED),
    ],
)
def test_finish_again_with_same_outcome_is_idempotent(clock, outcome, retry, expected):
    enqueue(retry=retry)
    [c] = claim(register("w1"))
    assert finish(c, outcome, summary={"n": 1}) == expected
    before = snapshot()
    clock.advance(1)
    assert finish(c, outcome, summary={"n": 1}) == expected
    assert snapshot() == before


@pytest.mark.parametrize(
    "first, second", [("succeeded", "failed"), ("failed", "succeeded"), ("cancelled", "succeeded")]
)
def test_finish_again_with_another_outcome_is_stale(clock, first, second):
    enqueue()
    [c] = claim(register("w1"))
    finish(c, first)
    _assert_stale_and_unchanged(lambda: finish(c, second))


def test_finish_records_summary_and_settles_instance_and_task(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    assert finish(c, summary={"changed": 3}) == JobState.SUCCEEDED
    job.refresh_from_db()
    assert (job.state, job.summary, job.finished_at) == (JobState.SUCCEEDED, {"changed": 3}, clock.now())
    assert instance_state(job) == JobState.SUCCEEDED
    assert task_state_of(job) == JobState.SUCCEEDED
    assert events(job.pk) == ["enqueued", "claimed", "finished"]


# --------------------------------------------------------------------------- cancellation


def test_cancel_of_a_queued_job_ends_it_at_once(clock):
    job = enqueue()
    services.job_cancel(job_id=job.pk)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert instance_state(job) == JobState.CANCELLED
    assert task_state_of(job) == JobState.CANCELLED
    assert claim(register("w1")) == []
    assert events(job.pk) == ["enqueued", "cancelled"]


def test_cancel_by_instance(clock):
    job = enqueue()
    services.job_cancel(job_id=job.pk)
    assert job_state(job.pk) == JobState.CANCELLED


def test_cancel_of_a_leased_job_is_cooperative_and_wins_over_a_later_success(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    assert heartbeat(c).cancel is False
    services.job_cancel(job_id=job.pk)
    assert job_state(job.pk) == JobState.LEASED  # the worker still runs it
    assert Job.objects.get(pk=job.pk).cancel_requested_at == clock.now()
    assert heartbeat(c).cancel is True
    assert finish(c, "succeeded") == JobState.CANCELLED
    assert job_state(job.pk) == JobState.CANCELLED
    assert instance_state(job) == JobState.CANCELLED
    assert task_state_of(job) == JobState.CANCELLED
    assert finish(c, "succeeded") == JobState.CANCELLED  # a retried finish gets the same answer


def test_cancel_after_finish_changes_nothing(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    finish(c)
    before = snapshot()
    services.job_cancel(job_id=job.pk)
    services.job_cancel(job_id=job.pk)
    assert snapshot() == before
    assert job_state(job.pk) == JobState.SUCCEEDED


def test_cancel_of_unknown_job_is_not_found(clock):
    with pytest.raises(NotFound):
        services.job_cancel(job_id=424242)


# --------------------------------------------------------------------------- expiry


def test_expired_lease_requeues_the_job_for_another_worker(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    clock.advance(LEASE - 1)
    assert services.leases_expire() == []
    clock.advance(2)
    [expired] = services.leases_expire()
    assert expired.pk == c.attempt_id
    assert Attempt.objects.get(pk=c.attempt_id).state == AttemptState.EXPIRED
    job.refresh_from_db()
    assert (job.state, job.available_at, job.current_attempt_id) == (JobState.QUEUED, clock.now(), None)
    assert events(job.pk)[-1] == "expired"
    [again] = claim(register("w2"))
    assert (again.job_id, again.attempt_number) == (job.pk, 2)


def test_job_fails_after_max_attempts_expiries_with_a_reason_naming_it(clock):
    job = enqueue()  # default max_attempts: 5
    worker = register("w1")
    for number in range(1, 6):
        [c] = claim(worker)
        assert c.attempt_number == number
        clock.advance(LEASE + 1)
        services.leases_expire()
        assert job_state(job.pk) == (JobState.QUEUED if number < 5 else JobState.FAILED)
    job.refresh_from_db()
    assert "max_attempts" in job.reason and "5" in job.reason
    assert instance_state(job) == JobState.FAILED
    assert task_state_of(job) == JobState.FAILED
    assert claim(worker) == []


def test_max_attempts_from_config_and_per_job(clock, queue_config):
    queue_config(max_attempts=2)
    from_config, per_job = enqueue(), enqueue(max_attempts=1)
    worker = register("w1", capacity=2)
    claim(worker, 2)
    clock.advance(LEASE + 1)
    services.leases_expire()
    assert (job_state(from_config.pk), job_state(per_job.pk)) == (JobState.QUEUED, JobState.FAILED)


def test_max_attempts_counts_expiries_not_failed_finishes(clock, queue_config):
    queue_config(lease_duration=30)
    job = enqueue(max_attempts=2, retry=Retry(max_attempts=10))
    worker = register("w1")
    [c] = claim(worker)
    assert services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed") == JobState.QUEUED
    claim(worker)
    clock.advance(31)
    services.leases_expire()
    job.refresh_from_db()
    assert job.state == JobState.QUEUED  # one expiry of two allowed
    claim(worker)
    clock.advance(31)
    services.leases_expire()
    job.refresh_from_db()
    assert job.state == JobState.FAILED and "lease expired 2 times" in job.reason


def test_expiry_of_a_cancel_requested_job_ends_it_cancelled(clock):
    job = enqueue()
    claim(register("w1"))
    services.job_cancel(job_id=job.pk)
    clock.advance(LEASE + 1)  # the worker never heartbeats again
    services.leases_expire()
    assert job_state(job.pk) == JobState.CANCELLED
    assert instance_state(job) == JobState.CANCELLED


def test_register_again_expires_old_sessions_attempts_and_supersedes_its_calls(clock):
    job = enqueue()
    old = register("w1")
    [c] = claim(old)
    new = register("w1")  # the process restarted; its lease has not run out
    assert new.session != old.session
    assert Attempt.objects.get(pk=c.attempt_id).state == AttemptState.EXPIRED
    assert job_state(job.pk) == JobState.QUEUED
    before = snapshot()
    with pytest.raises(SessionSuperseded):
        claim(old)
    with pytest.raises(SessionSuperseded):
        services.worker_heartbeat(worker_id="w1", session=old.session)
    for call in (lambda: heartbeat(c), lambda: finish(c)):  # PROTOCOL: the old session's calls are superseded
        with pytest.raises(SessionSuperseded):
            call()
    assert snapshot() == before
    [again] = claim(new)
    assert (again.job_id, again.attempt_number) == (job.pk, 2)


def test_worker_heartbeat_answers_the_drain_request(clock):
    worker = register("w1")
    assert services.worker_heartbeat(worker_id="w1", session=worker.session).drain_requested is False
    services.worker_drain(worker_id="w1")
    assert services.worker_heartbeat(worker_id="w1", session=worker.session).drain_requested is True
    services.worker_undrain(worker_id="w1")
    assert services.worker_heartbeat(worker_id="w1", session=worker.session).drain_requested is False


def test_worker_heartbeat_records_time_and_state(clock):
    worker = register("w1")
    clock.advance(7)
    services.worker_heartbeat(worker_id="w1", session=worker.session, draining=True, ready=False)
    worker.refresh_from_db()
    assert (worker.last_heartbeat_at, worker.draining, worker.ready) == (clock.now(), True, False)


def test_drain_of_unknown_worker_is_not_found(clock):
    with pytest.raises(NotFound):
        services.worker_drain(worker_id="ghost")


# --------------------------------------------------------------------------- workflow retry


def test_failed_attempt_retries_with_backoff_then_fails(clock):
    job = enqueue(retry=Retry(max_attempts=3, backoff=10))
    worker = register("w1")
    for number in (1, 2):
        [c] = claim(worker)
        assert c.attempt_number == number
        assert finish(c, "failed", error=f"exit 1 on try {number}") == JobState.QUEUED
        now = clock.now()
        available_at = Job.objects.get(pk=job.pk).available_at
        if number == 1:
            assert now + dt.timedelta(seconds=5) <= available_at <= now + dt.timedelta(seconds=10)
        else:  # later retries back off at least as long, never beyond backoff_max
            assert now + dt.timedelta(seconds=5) <= available_at <= now + dt.timedelta(seconds=300)
        assert claim(worker) == []
        clock.advance((available_at - now).total_seconds())
    [c] = claim(worker)
    assert finish(c, "failed", error="exit 1 on try 3") == JobState.FAILED
    job.refresh_from_db()
    assert job.reason == "exit 1 on try 3"
    assert instance_state(job) == JobState.FAILED
    assert claim(worker) == []


def test_without_retry_a_failed_attempt_fails_the_job(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    assert finish(c, "failed") == JobState.FAILED
    assert job_state(job.pk) == JobState.FAILED


def test_backoff_of_a_long_failing_job_stays_at_its_cap():
    assert 150 <= _backoff(1.0, 300.0, 1100) <= 300


# --------------------------------------------------------------------------- reconciliation


def test_reconcile_expires_leases_that_ran_out_while_down(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    clock.advance(LEASE + 60)
    assert services.reconcile() == 1
    assert Attempt.objects.get(pk=c.attempt_id).state == AttemptState.EXPIRED
    assert job_state(job.pk) == JobState.QUEUED


def test_reconcile_leaves_live_leases_alone(clock):
    job = enqueue()
    claim(register("w1"))
    clock.advance(LEASE - 1)
    before = snapshot()
    assert services.reconcile() == 0
    assert snapshot() == before
    assert job_state(job.pk) == JobState.LEASED


def test_instance_and_task_state_are_the_jobs_so_nothing_can_drift(clock):
    # There is no copy to repair: a job moved by any means (here: behind the
    # services' back, as an older version or a crash between writes might
    # have left it) is what the instance and the task show at once.
    job = enqueue()
    [c] = claim(register("w1"))
    finish(c, summary={"ok": True})
    assert (instance_state(job), task_state_of(job)) == (JobState.SUCCEEDED, JobState.SUCCEEDED)
    Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED)
    assert (instance_state(job), task_state_of(job)) == (JobState.CANCELLED, JobState.CANCELLED)


def test_reconcile_of_an_agreeing_database_changes_nothing(clock):
    job = enqueue()
    [c] = claim(register("w1"))
    finish(c)
    enqueue()
    before = snapshot()
    assert services.reconcile() == 0
    assert snapshot() == before
    assert job_state(job.pk) == JobState.SUCCEEDED
