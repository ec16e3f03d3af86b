"""The worker runtime on the in-process transport, driven step by step.

`run_once`-style calls (claim_once, heartbeat_once) with a fake monotonic
clock for the worker and the frozen clock for the control plane: no test
waits for a lease, only for job threads to do what they were told.
"""

import threading
import time

import pytest

from jobqueue import services
from jobqueue.exceptions import StaleAttempt
from jobqueue.models import Job, JobState
from tests.factories import enqueue
from workers.executor import Outcome
from workers.localdb import LocalDB
from workers.runtime import WorkerRuntime
from workers.transport import InProcessTransport, TransportError, WorkerSpec

pytestmark = pytest.mark.django_db(transaction=True)

LEASE, BEAT = 30.0, 10.0


class FakeMonotonic:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedExecutor:
    """Runs a job by waiting until released (or cancelled); records what it saw."""

    def __init__(self, outcome: str = "succeeded", block: bool = False):
        self.outcome = outcome
        self.block = block
        self.release = threading.Event()
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def run(self, claim, cancel):
        self.started.set()
        while self.block and not self.release.is_set():
            if cancel.wait(0.01):
                self.cancelled.set()
                return Outcome("cancelled", {"seen": "cancel"}, "stopped")
        return Outcome(self.outcome, {"ran": claim.job_id})


class FlakyTransport(InProcessTransport):
    """In-process transport whose calls can be made to fail like a lost network."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.down = False
        self.finish_failures = 0

    def heartbeat(self, **kwargs):
        if self.down:
            raise TransportError("connection refused")
        return super().heartbeat(**kwargs)

    def worker_heartbeat(self, **kwargs):
        if self.down:
            raise TransportError("connection refused")
        return super().worker_heartbeat(**kwargs)

    def finish(self, **kwargs):
        if self.down or self.finish_failures:
            self.finish_failures = max(0, self.finish_failures - 1)
            raise TransportError("connection reset")
        return super().finish(**kwargs)


_made: list[WorkerRuntime] = []


@pytest.fixture(autouse=True)
def stop_runtimes():
    """Job threads must not outlive their test (and its database)."""
    yield
    while _made:
        runtime = _made.pop()
        with runtime.lock:
            jobs = list(runtime.active.values())
        for job in jobs:
            job.discard = job.discard or "test over"
            job.cancel.set()
        runtime.reap(wait=True)


def make_runtime(executor, *, transport=None, capacity=1, outbox=None, worker_id="w1"):
    spec = WorkerSpec(worker_id=worker_id, pool=None, labels=(), capabilities=("apiary.workflow", "runner:shell"), capacity=capacity)
    runtime = WorkerRuntime(
        transport=transport or FlakyTransport(worker_id=worker_id),
        spec=spec,
        executor=executor,
        claim_wait=0.0,
        monotonic=FakeMonotonic(),
        outbox=outbox,
    )
    runtime.start()
    _made.append(runtime)
    return runtime


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met before the deadline")


def job_state(job) -> str:
    return Job.objects.get(pk=job.pk).state


@pytest.fixture(autouse=True)
def queue_settings(queue_config, clock):
    queue_config(lease_duration=LEASE, heartbeat_interval=BEAT, worker_timeout=30)


def test_claims_runs_and_finishes(clock):
    job = enqueue()
    runtime = make_runtime(ScriptedExecutor())
    assert runtime.claim_once() == 1
    wait_for(lambda: job_state(job) == JobState.SUCCEEDED)
    runtime.reap(wait=True)
    assert runtime.idle() and runtime.finished_count == 1


def test_never_claims_beyond_capacity(clock):
    for _ in range(3):
        enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor, capacity=2)
    assert runtime.claim_once() == 2
    assert runtime.claim_once() == 0
    executor.release.set()
    runtime.reap(wait=True)
    assert runtime.claim_once() == 1


def test_cancel_answer_stops_the_runner_and_finishes_cancelled(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    services.job_cancel(job_id=job.pk)
    runtime.monotonic.now += BEAT  # the next attempt heartbeat is due
    runtime.heartbeat_once()
    wait_for(lambda: job_state(job) == JobState.CANCELLED)
    assert executor.cancelled.is_set()


def test_stale_heartbeat_discards_the_result(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    clock.advance(LEASE + 1)  # the control plane reclaims the job
    services.leases_expire()
    assert job_state(job) == JobState.QUEUED
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set)
    runtime.reap(wait=True)
    # The stale worker sent no finish: the job waits for its next attempt.
    assert job_state(job) == JobState.QUEUED
    assert runtime.finished_count == 0


def test_self_fences_when_the_control_plane_is_unreachable_past_the_lease(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    transport = FlakyTransport(worker_id="w1")
    runtime = make_runtime(executor, transport=transport)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    transport.down = True
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()  # fails, the runner keeps going: the lease still holds
    assert not executor.cancelled.is_set()
    runtime.monotonic.now += LEASE - BEAT - runtime.margin  # now at claim time + lease − margin
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set)
    runtime.reap(wait=True)
    assert job_state(job) == JobState.LEASED  # nothing was sent; the control plane will expire it
    assert not runtime.reachable()
    assert runtime.claim_once() == 0  # no claims while cut off


def test_acknowledged_heartbeats_move_the_fence(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    for _ in range(5):  # 5 × 10 s > the 30 s lease, but every heartbeat was acknowledged
        runtime.monotonic.now += BEAT
        clock.advance(BEAT)
        runtime.heartbeat_once()
    assert not executor.cancelled.is_set()
    executor.release.set()
    runtime.reap(wait=True)
    assert runtime.finished_count == 1


def test_operator_drain_reaches_the_worker_in_its_heartbeat(clock):
    enqueue()
    runtime = make_runtime(ScriptedExecutor())
    services.worker_drain(worker_id="w1")
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert runtime.draining.is_set()
    assert runtime.claim_once() == 0


def test_drain_lets_active_jobs_finish_then_reports_unready(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    runtime.request_drain("test")
    result = {}
    loop = threading.Thread(target=lambda: result.setdefault("code", runtime.run()))
    loop.start()
    time.sleep(0.05)
    assert loop.is_alive()  # waiting for the active job
    executor.release.set()
    loop.join(10)
    assert result["code"] == 0
    assert job_state(job) == JobState.SUCCEEDED
    from workers.models import Worker

    assert Worker.objects.get(pk="w1").ready is False


def test_superseded_session_is_fatal(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set)
    services.worker_register(worker_id="w1", capabilities=["apiary.workflow", "runner:shell"])  # another process
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert runtime.fatal and "another process registered" in runtime.fatal
    wait_for(executor.cancelled.is_set)


def test_finish_is_retried_until_acknowledged(clock):
    job = enqueue()
    transport = FlakyTransport(worker_id="w1")
    transport.finish_failures = 2
    runtime = make_runtime(ScriptedExecutor(), transport=transport)
    runtime.claim_once()
    wait_for(lambda: job_state(job) == JobState.SUCCEEDED)


def test_outbox_resends_a_finish_after_a_worker_restart(clock, tmp_path):
    job = enqueue()
    outbox = LocalDB(tmp_path / "w1.db")
    transport = FlakyTransport(worker_id="w1")
    transport.finish_failures = 10**6  # the finish never gets through before the "crash"
    first = make_runtime(ScriptedExecutor(), transport=transport, outbox=outbox)
    first.claim_once()
    wait_for(lambda: len(outbox.pending()) == 1)
    [entry] = outbox.pending()
    assert entry["outcome"] == "succeeded" and entry["job_id"] == job.pk
    first.draining.set()
    transport.finish_failures = 0
    # A new process with the same outbox: it delivers before registering (which would expire the attempt).
    second = make_runtime(ScriptedExecutor(), outbox=outbox)
    assert second.registration is not None
    assert job_state(job) == JobState.SUCCEEDED
    assert outbox.pending() == []
    with pytest.raises(StaleAttempt):  # the resent token is spent for good afterwards
        services.attempt_heartbeat(attempt_id=entry["attempt_id"], token=entry["token"])
