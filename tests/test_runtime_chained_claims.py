"""A job thread's finish claims its next job (InProcessTransport.finish_and_claim), and the
job claimed so is run, heartbeated and fenced like one the claim loop took; a worker that
drains claims nothing with its finishes. The runtime is driven step by step, as in
tests/test_runtime.py, whose helpers these tests share."""

import threading

import pytest

from jobqueue.models import Attempt, Job, JobState
from tests import test_runtime
from tests.factories import enqueue
from tests.test_runtime import BEAT, LEASE, WAIT, FlakyTransport, ScriptedExecutor, job_state, make_runtime
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# The autouse fixtures those helpers need: the queue's settings, and no job thread outliving its test.
queue_settings, stop_runtimes = test_runtime.queue_settings, test_runtime.stop_runtimes


class CountingTransport(FlakyTransport):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.claims = 0

    def claim(self, **kwargs):
        self.claims += 1
        return super().claim(**kwargs)


class ThreadsExecutor(ScriptedExecutor):
    """Records the thread each job ran on; blocks on the jobs named in `hold` until released."""

    def __init__(self, hold=()):
        super().__init__()
        self.hold = set(hold)
        self.threads: dict[int, int] = {}
        self.running: set[int] = set()

    def run(self, claim, cancel, *, grace, journal=None):
        self.threads[claim.job_id] = threading.get_ident()
        self.running.add(claim.job_id)
        self.block = claim.job_id in self.hold
        return super().run(claim, cancel, grace=grace, journal=journal)


def _first_of_two_running(executor):
    """Two jobs queued, a worker of capacity 1 running the first in `executor` (blocked until released)."""
    first, second = enqueue(), enqueue()
    runtime = make_runtime(executor, capacity=1)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    return runtime, first, second


def test_a_finish_claims_the_next_job_and_its_thread_runs_it(clock):
    jobs = [enqueue() for _ in range(3)]
    transport = CountingTransport(worker_id="w1")
    executor = ThreadsExecutor()
    runtime = make_runtime(executor, transport=transport, capacity=1)
    assert runtime.claim_once() == 1
    wait_for(lambda: all(job_state(j) == JobState.SUCCEEDED for j in jobs), timeout=WAIT, what="every job to succeed")
    runtime.reap(wait=True)
    assert runtime.finished_count == 3 and runtime.idle()
    # One claim_once, one claim: the other two jobs came with the finishes before them, on its thread.
    assert transport.claims == 1 and len(set(executor.threads.values())) == 1
    assert Attempt.objects.filter(worker_id="w1").count() == 3


def test_a_draining_worker_claims_nothing_with_its_finish(clock):
    executor = ScriptedExecutor(block=True)
    runtime, first, second = _first_of_two_running(executor)
    runtime.request_drain("test")
    executor.release.set()
    runtime.reap(wait=True)
    assert job_state(first) == JobState.SUCCEEDED
    assert job_state(second) == JobState.QUEUED
    assert runtime.finished_count == 1


def test_a_job_claimed_with_a_finish_is_heartbeated_and_fenced(clock):
    first, second = enqueue(), enqueue()
    executor = ThreadsExecutor(hold={second.pk})
    transport = FlakyTransport(worker_id="w1")
    runtime = make_runtime(executor, transport=transport, capacity=1)
    runtime.claim_once()
    wait_for(lambda: second.pk in executor.running, timeout=WAIT, what="the job claimed with the first one's finish to start")
    assert job_state(first) == JobState.SUCCEEDED and job_state(second) == JobState.LEASED
    [active] = runtime.active.values()
    assert active.claim.job_id == second.pk and active.thread.is_alive()
    attempt = Attempt.objects.get(pk=active.claim.attempt_id)
    runtime.monotonic.now += BEAT
    clock.advance(BEAT)
    runtime.heartbeat_once()  # its lease is extended like any claim's
    assert Attempt.objects.get(pk=attempt.pk).lease_expires_at > attempt.lease_expires_at
    transport.down = True
    runtime.monotonic.now += LEASE  # unacknowledged past its lease: it fences itself
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the fenced job's runner to be stopped")
    runtime.reap(wait=True)
    assert Job.objects.get(pk=second.pk).state == JobState.LEASED  # nothing sent; the control plane expires it
    assert runtime.finished_count == 1


def test_a_claim_that_breaks_its_finish_call_leaves_the_finish_to_be_sent_without_one(clock, monkeypatch, caplog):
    first, second = enqueue(), enqueue()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the claim")

    monkeypatch.setattr("jobqueue.services.chaining._claim", broken)
    runtime = make_runtime(ScriptedExecutor(), capacity=1)
    runtime.claim_once()
    wait_for(lambda: job_state(first) == JobState.SUCCEEDED, timeout=WAIT, what="the finish, sent again alone")
    runtime.reap(wait=True)
    assert runtime.finished_count == 1 and runtime.idle()
    assert job_state(second) == JobState.QUEUED  # for the claim loop
    assert "with a claim failed; sending it without one" in caplog.text


def test_a_worker_stopped_by_a_fatal_error_starts_no_job_its_finish_claimed(clock):
    executor = ScriptedExecutor(block=True)
    runtime, first, second = _first_of_two_running(executor)
    runtime.fatal = "superseded (test)"  # as _fatal sets it, before it stops the loops
    executor.release.set()
    runtime.reap(wait=True)
    assert runtime.active == {} and runtime.finished_count == 1 and job_state(first) == JobState.SUCCEEDED
    assert job_state(second) == JobState.LEASED  # claimed with the finish, never run: its lease runs out
