"""The job and attempt state machines, walked table-driven.

Every edge of JOB_TRANSITIONS / ATTEMPT_TRANSITIONS has a scenario that takes
it through public services (so an edge nobody can reach, or a scenario for an
edge the table does not allow, fails here), and `check_transition` rejects
every pair the tables leave out.
"""

import itertools

import pytest

from jobqueue import services
from jobqueue.models import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATES,
    Attempt,
    AttemptState,
    Job,
    JobState,
)
from jobqueue.services.transitions import check_transition
from jobqueue.types import Retry
from tests.factories import claim, enqueue, register

LEASE = 30.0


def _leased(**enqueue_kwargs):
    job = enqueue(**enqueue_kwargs)
    [c] = claim(register("w1"))
    return job, c


def _finish(c, outcome):
    return lambda: services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome=outcome)


def _expire(clock):
    def act():
        clock.advance(LEASE + 1)
        services.leases_expire()

    return act


# Each scenario sets the job up in the edge's source state and returns
# (job, attempt claim or None, the one service call that takes the edge).


def queued_to_leased(clock):
    job = enqueue()
    worker = register("w1")
    return job, None, lambda: claim(worker)


def queued_to_cancelled(clock):
    job = enqueue()
    return job, None, lambda: services.job_cancel(job_id=job.pk)


def leased_to_succeeded(clock):
    job, c = _leased()
    return job, c, _finish(c, "succeeded")


def leased_to_failed_by_finish(clock):
    job, c = _leased()
    return job, c, _finish(c, "failed")


def leased_to_failed_by_last_expiry(clock):
    job, c = _leased(max_attempts=1)
    return job, c, _expire(clock)


def leased_to_cancelled_by_finish(clock):
    job, c = _leased()
    return job, c, _finish(c, "cancelled")


def leased_to_cancelled_by_finish_after_cancel(clock):
    job, c = _leased()
    services.job_cancel(job_id=job.pk)
    return job, c, _finish(c, "succeeded")


def leased_to_cancelled_by_expiry_after_cancel(clock):
    job, c = _leased()
    services.job_cancel(job_id=job.pk)
    return job, c, _expire(clock)


def leased_to_queued_by_expiry(clock):
    job, c = _leased()
    return job, c, _expire(clock)


def leased_to_queued_by_retry(clock):
    job, c = _leased(retry=Retry(max_attempts=2, backoff=1))
    return job, c, _finish(c, "failed")


def leased_to_queued_by_reregistration(clock):
    job, c = _leased()
    return job, c, lambda: register("w1")


def failed_to_queued_by_operator_retry(clock):
    job, c = _leased()
    _finish(c, "failed")()
    return job, None, lambda: services.job_retry(job_id=job.pk, actor="ops")


def cancelled_to_queued_by_operator_retry(clock):
    job = enqueue()
    services.job_cancel(job_id=job.pk)
    return job, None, lambda: services.job_retry(job_id=job.pk, actor="ops")


# (job from, job to, attempt to or None): scenarios
JOB_SCENARIOS = {
    (JobState.QUEUED, JobState.LEASED, None): [queued_to_leased],
    (JobState.QUEUED, JobState.CANCELLED, None): [queued_to_cancelled],
    (JobState.LEASED, JobState.SUCCEEDED, AttemptState.SUCCEEDED): [leased_to_succeeded],
    (JobState.LEASED, JobState.FAILED, AttemptState.FAILED): [leased_to_failed_by_finish],
    (JobState.LEASED, JobState.FAILED, AttemptState.EXPIRED): [leased_to_failed_by_last_expiry],
    (JobState.LEASED, JobState.CANCELLED, AttemptState.CANCELLED): [leased_to_cancelled_by_finish],
    (JobState.LEASED, JobState.CANCELLED, AttemptState.SUCCEEDED): [leased_to_cancelled_by_finish_after_cancel],
    (JobState.LEASED, JobState.CANCELLED, AttemptState.EXPIRED): [leased_to_cancelled_by_expiry_after_cancel],
    (JobState.LEASED, JobState.QUEUED, AttemptState.EXPIRED): [
        leased_to_queued_by_expiry,
        leased_to_queued_by_reregistration,
    ],
    (JobState.LEASED, JobState.QUEUED, AttemptState.FAILED): [leased_to_queued_by_retry],
    (JobState.FAILED, JobState.QUEUED, None): [failed_to_queued_by_operator_retry],
    (JobState.CANCELLED, JobState.QUEUED, None): [cancelled_to_queued_by_operator_retry],
}

CASES = [
    pytest.param(src, dst, attempt_dst, scenario, id=scenario.__name__)
    for (src, dst, attempt_dst), scenarios in JOB_SCENARIOS.items()
    for scenario in scenarios
]


@pytest.mark.django_db
@pytest.mark.parametrize("src, dst, attempt_dst, scenario", CASES)
def test_edge_is_taken_by_a_service_call(clock, src, dst, attempt_dst, scenario):
    job, c, act = scenario(clock)
    assert Job.objects.get(pk=job.pk).state == src
    if c is not None:
        assert Attempt.objects.get(pk=c.attempt_id).state == AttemptState.ACTIVE
    act()
    assert Job.objects.get(pk=job.pk).state == dst
    if c is not None:
        assert Attempt.objects.get(pk=c.attempt_id).state == attempt_dst


def test_every_legal_job_edge_has_a_scenario():
    legal = {(src, dst) for src, targets in JOB_TRANSITIONS.items() for dst in targets}
    covered = {(src, dst) for src, dst, _ in JOB_SCENARIOS}
    assert covered == legal


def test_every_legal_attempt_edge_has_a_scenario():
    legal = {(src, dst) for src, targets in ATTEMPT_TRANSITIONS.items() for dst in targets}
    covered = {(AttemptState.ACTIVE, a) for _, _, a in JOB_SCENARIOS if a is not None}
    assert covered == legal


def test_tables_cover_every_state():
    assert set(JOB_TRANSITIONS) == set(JobState.values)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState.values)
    for table, states in ((JOB_TRANSITIONS, JobState.values), (ATTEMPT_TRANSITIONS, AttemptState.values)):
        assert all(targets <= set(states) for targets in table.values())


def test_terminal_states_leave_only_by_an_operators_retry():
    assert {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED} == TERMINAL_JOB_STATES
    assert JOB_TRANSITIONS[JobState.SUCCEEDED] == frozenset()  # a success is never undone
    for state in (JobState.FAILED, JobState.CANCELLED):
        assert JOB_TRANSITIONS[state] == frozenset({JobState.QUEUED})  # job_retry, and nothing else
    for state in AttemptState.values:
        if state != AttemptState.ACTIVE:
            assert ATTEMPT_TRANSITIONS[state] == frozenset()


@pytest.mark.parametrize(
    "table, states",
    [
        pytest.param(JOB_TRANSITIONS, JobState.values, id="job"),
        pytest.param(ATTEMPT_TRANSITIONS, AttemptState.values, id="attempt"),
    ],
)
def test_check_transition_allows_exactly_the_table(table, states):
    for old, new in itertools.product(states, repeat=2):
        if new in table[old]:
            check_transition(table, old, new)
        else:
            with pytest.raises(AssertionError, match="illegal transition"):
                check_transition(table, old, new)
