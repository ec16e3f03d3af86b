"""The worker runtime on the in-process transport, driven step by step.

`run_once`-style calls (claim_once, heartbeat_once) with a fake monotonic
clock for the worker and the frozen clock for the control plane: no test
waits for a lease, only for job threads to do what they were told.
"""

import threading
import time

import pytest

from jobqueue import selectors, services
from jobqueue.exceptions import StaleAttempt
from jobqueue.models import Job, JobState
from tests.factories import enqueue
from tests.waiting import wait_for
from workers.executor import Outcome
from workers.localdb import LocalDB
from workers.runtime import WorkerRuntime
from workers.transport import InProcessTransport, TransportError, Unauthorized, WorkerSpec

pytestmark = pytest.mark.django_db(transaction=True)

LEASE, BEAT = 30.0, 10.0
WAIT = 10.0  # the deadline of each wait for a job thread


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
        self.graces: list[float] = []

    def run(self, claim, cancel, *, grace, journal=None):
        self.graces.append(grace)
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

    def _finish_fails(self) -> None:
        if self.down or self.finish_failures:
            self.finish_failures = max(0, self.finish_failures - 1)
            raise TransportError("connection reset")

    def finish(self, **kwargs):
        self._finish_fails()
        return super().finish(**kwargs)

    def finish_and_claim(self, **kwargs):  # the first try of a finish (the runtime claims with it)
        self._finish_fails()
        return super().finish_and_claim(**kwargs)


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


def job_state(job) -> str:
    return Job.objects.get(pk=job.pk).state


@pytest.fixture(autouse=True)
def queue_settings(queue_config, clock):
    queue_config(lease_duration=LEASE, heartbeat_interval=BEAT, worker_timeout=30)


def test_claims_runs_and_finishes(clock):
    job = enqueue()
    runtime = make_runtime(ScriptedExecutor())
    assert runtime.claim_once() == 1
    wait_for(lambda: job_state(job) == JobState.SUCCEEDED, timeout=WAIT, what="the job to succeed")
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
    # The third job went to the first of them to finish, claimed with its finish.
    assert runtime.finished_count == 3 and runtime.claim_once() == 0


def test_cancel_answer_stops_the_runner_and_finishes_cancelled(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    services.job_cancel(job_id=job.pk)
    runtime.monotonic.now += BEAT  # the next attempt heartbeat is due
    runtime.heartbeat_once()
    wait_for(lambda: job_state(job) == JobState.CANCELLED, timeout=WAIT, what="the job to be cancelled")
    assert executor.cancelled.is_set()


def test_stale_heartbeat_discards_the_result(clock):
    job = enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    clock.advance(LEASE + 1)  # the control plane reclaims the job
    services.leases_expire()
    assert job_state(job) == JobState.QUEUED
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the executor to see the cancel")
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
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    transport.down = True
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()  # fails, the runner keeps going: the lease still holds
    assert not executor.cancelled.is_set()
    runtime.monotonic.now += LEASE - BEAT - runtime.margin  # now at claim time + lease − margin
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the executor to see the cancel")
    runtime.reap(wait=True)
    assert job_state(job) == JobState.LEASED  # nothing was sent; the control plane will expire it
    assert not runtime.reachable()
    assert runtime.claim_once() == 0  # no claims while cut off


def test_acknowledged_heartbeats_move_the_fence(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
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
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
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
    from jobqueue.models import Worker

    assert Worker.objects.get(pk="w1").ready is False


def test_superseded_session_is_fatal(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    runtime = make_runtime(executor)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    services.worker_register(worker_id="w1", capabilities=["apiary.workflow", "runner:shell"])  # another process
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert runtime.fatal and "another process registered" in runtime.fatal
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the executor to see the cancel")


class SlowFinishTransport(FlakyTransport):
    """The finish commits, then its answer is held until released."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.committed = threading.Event()
        self.answer = threading.Event()

    def _held(self, answer):
        self.committed.set()
        self.answer.wait(WAIT)
        return answer

    def finish(self, **kwargs):
        return self._held(super().finish(**kwargs))

    def finish_and_claim(self, **kwargs):
        return self._held(super().finish_and_claim(**kwargs))


def test_a_heartbeat_answered_stale_because_the_finish_landed_discards_nothing(clock, caplog):
    job = enqueue()
    transport = SlowFinishTransport(worker_id="w1")
    runtime = make_runtime(ScriptedExecutor(), transport=transport)
    runtime.claim_once()
    wait_for(transport.committed.is_set, timeout=WAIT, what="the finish to commit")
    runtime.monotonic.now += BEAT
    with caplog.at_level("WARNING", logger="apiary.worker"):
        runtime.heartbeat_once()  # the attempt has ended: the control plane answers stale
        transport.answer.set()
        runtime.reap(wait=True)
    assert job_state(job) == JobState.SUCCEEDED and runtime.finished_count == 1
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_finish_is_retried_until_acknowledged(clock):
    job = enqueue()
    transport = FlakyTransport(worker_id="w1")
    transport.finish_failures = 2
    runtime = make_runtime(ScriptedExecutor(), transport=transport)
    runtime.claim_once()
    wait_for(lambda: job_state(job) == JobState.SUCCEEDED, timeout=WAIT, what="the job to succeed")


class LastRecordExecutor(ScriptedExecutor):
    """Ends as the real executor does: its last step's log streamed and its success recorded to
    commit with the finish."""

    def __init__(self, log_dir=None, sender_thread=False, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = log_dir
        self.sender_thread = sender_thread  # the step's output starts the log sender's thread (the runner's on_output)

    def run(self, claim, cancel, *, grace, journal=None):
        if self.log_dir is not None:
            path = self.log_dir / f"{claim.job_id}.log"
            path.write_bytes(b"")
            journal.logs.step_started("last", path)
            path.write_bytes(b"the step's output\n")
            if self.sender_thread:
                journal.logs.output_written()
            journal.logs.step_ended("last")
        journal.record_before_finish("step:last", "done", {"output": "ok"})
        return super().run(claim, cancel, grace=grace, journal=journal)


class LosingBatchTransport(FlakyTransport):
    """A finish that fails takes down what was queued to commit with it, as a failed batch does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.queued: list[tuple[str, dict]] = []

    def log_append_later(self, **call):
        self.queued.append(("log_append_later", call))

    def _with_queued(self, send, kwargs):
        queued, self.queued = self.queued, []
        if self.finish_failures:
            return send(**kwargs)  # raises; what was queued is lost with it
        for method, call in queued:
            getattr(super(), method)(**call)
        return send(**kwargs)

    def finish(self, **kwargs):
        return self._with_queued(super().finish, kwargs)

    def finish_and_claim(self, **kwargs):
        return self._with_queued(super().finish_and_claim, kwargs)


@pytest.mark.parametrize("sender_thread", [False, True], ids=["carried by the finish", "queued by the sender's thread"])
def test_a_retried_finish_carries_the_last_steps_record_and_log_again(clock, tmp_path, sender_thread):
    job = enqueue()
    transport = LosingBatchTransport(worker_id="w1")
    transport.finish_failures = 2
    runtime = make_runtime(LastRecordExecutor(log_dir=tmp_path, sender_thread=sender_thread), transport=transport)
    runtime.claim_once()
    wait_for(lambda: job_state(job) == JobState.SUCCEEDED, timeout=WAIT, what="the job to succeed")
    assert services.records_of_job(job.pk)["step:last"].state == "done"
    [stream] = selectors.log_streams(job_id=job.pk)
    assert (stream.name, stream.received, stream.ended) == ("last", len(b"the step's output\n"), True)


def test_outbox_resends_a_finish_after_a_worker_restart(clock, tmp_path):
    job = enqueue()
    outbox = LocalDB(tmp_path / "w1.db")
    transport = FlakyTransport(worker_id="w1")
    transport.finish_failures = 10**6  # the finish never gets through before the "crash"
    first = make_runtime(ScriptedExecutor(), transport=transport, outbox=outbox)
    first.claim_once()
    wait_for(lambda: len(outbox.pending()) == 1, timeout=WAIT, what="one finish in the outbox")
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


# ----------------------------------------------------------------------------- found in review


class SlowClaimTransport(FlakyTransport):
    """A long-poll that answers late: the worker's clock moves while it waits."""

    def __init__(self, clock_to_move, seconds, **kwargs):
        super().__init__(**kwargs)
        self.clock_to_move, self.seconds = clock_to_move, seconds
        self.heartbeats = 0

    def claim(self, **kwargs):
        self.clock_to_move.now += self.seconds
        return super().claim(**kwargs)

    def heartbeat(self, **kwargs):
        self.heartbeats += 1
        return super().heartbeat(**kwargs)


def test_a_job_claimed_late_in_a_long_poll_is_confirmed_not_fenced(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    fake = FakeMonotonic()
    transport = SlowClaimTransport(fake, LEASE, worker_id="w1")  # the answer came a whole lease after the request
    runtime = make_runtime(executor, transport=transport)
    runtime.monotonic = fake
    assert runtime.claim_once(wait=LEASE) == 1
    assert transport.heartbeats == 1  # confirmed before its runner started
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    runtime.heartbeat_once()
    assert not executor.cancelled.is_set()
    executor.release.set()
    runtime.reap(wait=True)
    assert runtime.finished_count == 1


def test_a_self_fenced_step_is_dead_before_its_lease_ends(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    transport = FlakyTransport(worker_id="w1")
    clock_ = FakeMonotonic()
    runtime = WorkerRuntime(
        transport=transport,
        spec=WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=("apiary.workflow", "runner:shell"), capacity=1),
        executor=executor,
        claim_wait=0.0,
        monotonic=clock_,
        grace=5.0,  # longer than the whole lease below
    )
    from jobqueue import conf

    conf.configure(conf.QueueConfig(lease_duration=4.0, heartbeat_interval=1.0, worker_timeout=4.0))
    runtime.start()
    _made.append(runtime)
    assert runtime.grace == 1.0  # clamped to a quarter of the lease
    # SIGTERM at fence_after, SIGKILL `grace` later: both inside the lease, with the margin to spare.
    assert runtime.fence_after + runtime.grace + runtime.margin == pytest.approx(4.0)
    assert runtime.beat_every <= runtime.fence_after / 2
    # The executor is handed the clamped grace with each claim.
    assert runtime.claim_once() == 1
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")
    assert executor.graces == [1.0]


def test_a_refused_token_stops_every_runner(clock):
    enqueue()
    executor = ScriptedExecutor(block=True)
    transport = FlakyTransport(worker_id="w1")
    runtime = make_runtime(executor, transport=transport)
    runtime.claim_once()
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to start the job")

    def refused(**kwargs):
        raise Unauthorized("wrong token")

    transport.worker_heartbeat = refused
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert runtime.fatal and "refused the worker token" in runtime.fatal
    # nothing would heartbeat or fence it any more
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the executor to see the cancel")


def test_start_does_not_register_while_the_outbox_cannot_be_delivered(clock, tmp_path):
    job = enqueue()
    outbox = LocalDB(tmp_path / "w1.db")
    transport = FlakyTransport(worker_id="w1")
    transport.finish_failures = 10**6
    first = make_runtime(ScriptedExecutor(), transport=transport, outbox=outbox)
    first.claim_once()
    wait_for(lambda: len(outbox.pending()) == 1, timeout=WAIT, what="one finish in the outbox")
    first.draining.set()
    second = WorkerRuntime(
        transport=transport, spec=first.spec, executor=ScriptedExecutor(), monotonic=FakeMonotonic(), outbox=outbox
    )
    with pytest.raises(TransportError):
        second.start()  # registering now would expire the attempt whose finish is still undelivered
    transport.finish_failures = 0
    second.start()
    _made.append(second)
    assert job_state(job) == JobState.SUCCEEDED


def test_outbox_keeps_two_finishes_of_the_same_attempt_id(tmp_path):
    # Attempt ids start again when the control plane's database is recreated.
    from jobqueue.types import Claim

    outbox = LocalDB(tmp_path / "w.db")
    for token in ("old", "new"):
        claim = Claim(1, 7, 1, token, None, "a", "shell", {"workflow": "wf", "instance_id": 1, "task": {"id": 1}})
        outbox.record_finish(claim=claim, outcome="succeeded", summary={}, error=None)
    assert [e["token"] for e in outbox.pending()] == ["old", "new"]


def test_an_operator_drain_pauses_the_embedded_worker_until_lifted(clock):
    enqueue()
    runtime = make_runtime(ScriptedExecutor())
    runtime.exit_on_drain = False
    services.worker_drain(worker_id="w1")
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert runtime.draining.is_set() and runtime.claim_once() == 0
    services.worker_undrain(worker_id="w1")
    runtime.monotonic.now += BEAT
    runtime.heartbeat_once()
    assert not runtime.draining.is_set()
    assert runtime.claim_once() == 1


def test_an_unexpected_claim_error_does_not_end_the_worker(clock):
    enqueue()
    transport = FlakyTransport(worker_id="w1")
    calls = {"n": 0}
    real_claim = transport.claim

    def odd_then_fine(**kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("jobs")  # e.g. a 200 without the field
        return real_claim(**kwargs)

    transport.claim = odd_then_fine
    executor = ScriptedExecutor()
    runtime = make_runtime(executor, transport=transport)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    wait_for(lambda: runtime.finished_count == 1, timeout=WAIT, what="one job finished")
    runtime.request_drain("test over")
    loop.join(10)
    assert not loop.is_alive() and runtime.fatal is None


def test_a_worker_at_capacity_claims_again_when_a_job_ends_not_on_a_timer(clock, monkeypatch):
    # A slot wait far longer than the test's deadline: the next claim can only come from the
    # ending job's wake (runtime.freed), never from the wait running out.
    monkeypatch.setattr("workers.runtime.SLOT_WAIT", 3600.0)
    jobs = [enqueue() for _ in range(3)]
    runtime = make_runtime(ScriptedExecutor(), capacity=1)
    runtime.finish_and_claim = None  # finishes that claim nothing: each next job is the claim loop's
    loop = threading.Thread(target=runtime.run, daemon=True)
    loop.start()
    try:
        wait_for(lambda: all(job_state(j) == JobState.SUCCEEDED for j in jobs), timeout=WAIT, what="three jobs, one slot")
    finally:
        runtime.request_drain("test over")
        loop.join(WAIT)
    assert not loop.is_alive() and runtime.finished_count == 3


def test_a_job_whose_thread_cannot_start_frees_its_slot(clock, monkeypatch):
    enqueue()
    runtime = make_runtime(ScriptedExecutor(), capacity=1)

    def refused(fn, name):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(runtime.job_threads, "start", refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        runtime.claim_once()
    assert runtime.active == {}  # its lease runs out and the job is claimed again; the slot is free now
    runtime.reap(wait=True)
