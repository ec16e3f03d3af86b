"""Transport conformance: one suite of runtime behaviours, run over both transports.

The worker runtime (`workers.runtime.WorkerRuntime`) talks to the queue through
a transport: `InProcessTransport` calls the queue services directly (the
embedded worker), `HttpTransport` speaks protocol v1 to a control plane (remote
workers). The runtime must not be able to tell them apart, so every test here
is run twice, once per `transport_kind`, and asserts the same observable
outcome either way: job and attempt rows, what the runtime did (the calls it
made through the transport and what came back), the exceptions raised. The
model is River's driver test suite: one behaviour, every driver.

The HTTP kind runs against pytest-django's `live_server` (Django's threaded
test server serving apiary_site.urls, in this process), so both kinds share
the real queue services, the database and the injected FrozenClock (the
`clock` fixture). Both kinds use transactional tests so they run the same way.

Time: the control plane's clock is the FrozenClock; the worker's self-fencing
clock is a `FakeMonotonic` passed as `monotonic=`. Tests move both by hand and
drive the runtime with `claim_once()` / `heartbeat_once()`; nothing sleeps for
a lease, and the only waits are `tests.waiting.wait_for`'s bounded waits for a
thread the test set going.

On SQLite the live server's request threads share the test's one in-memory
connection, so the tests keep control-plane calls sequential: database reads
happen after the runtime's job threads were joined (`reap(wait=True)`).
"""

import contextlib
import dataclasses
import datetime as dt
import sqlite3
import threading

import pytest
from django.db import connection

from jobqueue import services
from jobqueue.exceptions import InvalidRequest, QueueError, SessionSuperseded, StaleAttempt
from jobqueue.models import Attempt, AttemptState, Job, JobState, Worker
from jobqueue.selectors import log_read
from tests.api.conftest import CANARY
from tests.factories import enqueue, instance_id, make_task, task_id
from tests.waiting import wait_for
from tests.workers.connections import hang_up_all
from workers.credentials import CredentialFile
from workers.executor import Outcome
from workers.http import HttpTransport
from workers.journal import Checkpoint, JournalError
from workers.localdb import LocalDB
from workers.runtime import WorkerRuntime
from workers.transport import InProcessTransport, TransportError, WorkerSpec

pytestmark = pytest.mark.django_db(transaction=True)

LEASE, BEAT = 30.0, 10.0
WAIT = 10.0  # deadline for a thread the test set going; not a timing assertion
CAPABILITIES = ("apiary.workflow", "runner:shell")  # what tests.factories.enqueue() requires


# ----------------------------------------------------------------------------- doubles


class FakeMonotonic:
    """The worker's own clock (self-fencing, heartbeat schedule); moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeExecutor:
    """Runs a claimed job the way the workflow executor does, minus the steps:
    returns `outcome` at once, or with `hold=True` once the test sets
    `release`; a cancel from the runtime ends a held job as `cancelled`."""

    def __init__(self, outcome: str = "succeeded", *, hold: bool = False):
        self.outcome, self.hold = outcome, hold
        self.release = threading.Event()
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.claims = []

    def run(self, claim, cancel, *, grace, journal=None) -> Outcome:
        self.claims.append(claim)
        self.started.set()
        while self.hold and not self.release.is_set():
            if cancel.wait(0.01):
                self.cancelled.set()
                return Outcome("cancelled", {"stopped": claim.job_id}, "stopped by the runtime")
        return Outcome(self.outcome, {"ran": claim.job_id})


@dataclasses.dataclass
class Call:
    name: str
    args: dict
    result: object = None
    error: Exception | None = None


class Wire:
    """A transport as the runtime sees it: every call it made and what came
    back. With `finish_down` a finish fails before it leaves the worker, as
    on a lost network (TransportError, which the runtime retries)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[Call] = []
        self.finish_down = False
        self.log_answers_lost = 0

    def _call(self, name, fn, **args):
        call = Call(name, args)
        self.calls.append(call)
        try:
            call.result = fn(**args)
        except QueueError as exc:
            call.error = exc
            raise
        return call.result

    def register(self, spec):
        return self._call("register", self.inner.register, spec=spec)

    def worker_heartbeat(self, **args):
        return self._call("worker_heartbeat", self.inner.worker_heartbeat, **args)

    def claim(self, **args):
        return self._call("claim", self.inner.claim, **args)

    def heartbeat(self, **args):
        return self._call("heartbeat", self.inner.heartbeat, **args)

    def finish(self, **args):
        def send(**args):
            if self.finish_down:
                raise TransportError("connection reset (test)")
            return self.inner.finish(**args)

        return self._call("finish", send, **args)

    def record(self, **args):
        return self._call("record", self.inner.record, **args)

    def records(self, **args):
        return self._call("records", self.inner.records, **args)

    def log_append(self, **args):
        def send(**args):
            answer = self.inner.log_append(**args)
            if self.log_answers_lost:  # it arrived; its answer did not
                self.log_answers_lost -= 1
                raise TransportError("connection reset after sending (test)")
            return answer

        return self._call("log_append", send, **args)

    def close(self):
        self.inner.close()

    def of(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(params=["in_process", "http", "asgi"])
def transport_kind(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def control_plane(queue_config, clock, settings):
    """The queue's settings, and the worker token as
    tests/api/conftest.py's `worker_token` sets them."""
    queue_config(lease_duration=LEASE, heartbeat_interval=BEAT, worker_timeout=LEASE)
    settings.APIARY_WORKER_TOKEN = CANARY


@pytest.fixture
def make_transport(transport_kind, request, tmp_path):
    """`make_transport(worker_id)`: a transport of this test's kind: in
    process, HTTP to the WSGI live server, or HTTP to the listener's ASGI
    application (tests/asgi_server.py). Both servers are session-scoped.
    HTTP transports of one worker id share its credential file, as the
    processes of one worker's state directory do."""
    made = []
    server = {"http": "live_server", "asgi": "asgi_server"}.get(transport_kind)
    url = request.getfixturevalue(server).url if server else None

    def make(worker_id: str = "w1"):
        if transport_kind == "in_process":
            transport = InProcessTransport(worker_id=worker_id)
        else:
            credential = CredentialFile(tmp_path / "workers" / f"{worker_id}.credential")
            transport = HttpTransport(base_url=url, token=CANARY, worker_id=worker_id, credential_file=credential)
        made.append(transport)
        return transport

    yield make
    hang_up_all(made)


@pytest.fixture
def make_runtime(make_transport):
    """`make_runtime(executor, …)`: a started WorkerRuntime on a `Wire` around
    a transport of this test's kind, with a fake monotonic clock and no long
    poll. exit_on_drain=True: it behaves as a remote worker does."""
    made: list[WorkerRuntime] = []

    def build(executor, *, worker_id="w1", capacity=1, outbox=None) -> WorkerRuntime:
        runtime = WorkerRuntime(
            transport=Wire(make_transport(worker_id)),
            spec=spec(worker_id, capacity),
            executor=executor,
            claim_wait=0.0,
            monotonic=FakeMonotonic(),
            outbox=outbox,
            exit_on_drain=True,
        )
        made.append(runtime)
        runtime.start()
        return runtime

    yield build
    for runtime in made:  # no job thread outlives its test (and its database)
        crash(runtime, "test over")


# ----------------------------------------------------------------------------- helpers


def spec(worker_id: str = "w1", capacity: int = 1) -> WorkerSpec:
    return WorkerSpec(worker_id=worker_id, pool=None, labels=(), capabilities=CAPABILITIES, capacity=capacity)


def tick(runtime: WorkerRuntime, seconds: float = BEAT) -> None:
    """Move the worker's own clock: the next heartbeats come due."""
    runtime.monotonic.now += seconds


def crash(runtime: WorkerRuntime, why: str = "the process died") -> None:
    """Stop every runner and drop its result, as a killed process would; joins its job threads."""
    with runtime.lock:
        jobs = list(runtime.active.values())
    for job in jobs:
        job.discard = job.discard or why
        job.cancel.set()
    runtime.reap(wait=True)


def fresh(job: Job) -> Job:
    return Job.objects.get(pk=job.pk)


def attempts_of(job: Job) -> list[Attempt]:
    return list(Attempt.objects.filter(job_id=job.pk).order_by("number"))


def in_seconds(clock, seconds: float) -> dt.datetime:
    return clock.now() + dt.timedelta(seconds=seconds)


def error_of(call):
    """The type of the queue error `call()` raised, None if it raised none."""
    try:
        call()
    except QueueError as exc:
        return type(exc)
    return None


# ----------------------------------------------------------------------------- the behaviours


def running_held_job(make_runtime):
    """A runtime that has claimed one job whose runner is running and holds until stopped."""
    executor = FakeExecutor(hold=True)
    runtime = make_runtime(executor)
    assert runtime.claim_once() == 1
    wait_for(executor.started.is_set, timeout=WAIT, what="the runner to start")
    return executor, runtime

def test_register_and_claim_hand_back_the_enqueued_job_unchanged_with_the_configured_lease(make_transport, clock):
    task = make_task(title="Ünïcode title", body="line one\nline two", payload={"labels": ["a", "b"], "n": 3, "x": None})
    job = enqueue(task, workflow="review")
    transport = make_transport("w1")

    registration = transport.register(spec("w1"))
    assert (registration.lease_duration, registration.heartbeat_interval) == (LEASE, BEAT)

    [claim] = transport.claim(session=registration.session, max_jobs=5, wait=0)
    assert (claim.job_id, claim.attempt_number, claim.agent, claim.runner) == (job.pk, 1, "engineer", "shell")
    assert claim.payload == job.payload  # the queue hands the payload back as enqueued
    assert set(claim.payload) == {"workflow", "instance_id", "task"}
    assert claim.payload["workflow"] == "review"
    assert claim.payload["instance_id"] == instance_id(job)
    assert claim.payload["task"]["id"] == task_id(job)
    assert claim.payload["task"]["payload"] == {"labels": ["a", "b"], "n": 3, "x": None}
    assert claim.lease_expires_at == in_seconds(clock, LEASE)

    assert transport.claim(session=registration.session, max_jobs=5, wait=0) == []
    assert fresh(job).state == JobState.LEASED
    [attempt] = attempts_of(job)
    assert (attempt.pk, attempt.state, attempt.lease_expires_at) == (claim.attempt_id, AttemptState.ACTIVE, claim.lease_expires_at)


def test_a_heartbeat_extends_the_lease_and_a_requested_cancel_stops_the_runner_and_ends_the_job_cancelled(
    make_runtime, clock
):
    job = enqueue()
    executor, runtime = running_held_job(make_runtime)
    claimed_until = attempts_of(job)[0].lease_expires_at

    clock.advance(BEAT)
    tick(runtime)
    runtime.heartbeat_once()
    [beat] = runtime.transport.of("heartbeat")
    assert beat.result.cancel is False
    assert beat.result.lease_expires_at == in_seconds(clock, LEASE) > claimed_until
    assert attempts_of(job)[0].lease_expires_at == beat.result.lease_expires_at
    assert not executor.cancelled.is_set()

    services.job_cancel(job_id=job.pk)
    clock.advance(BEAT)
    tick(runtime)
    runtime.heartbeat_once()
    assert [call.result.cancel for call in runtime.transport.of("heartbeat")] == [False, True]
    runtime.reap(wait=True)

    assert executor.cancelled.is_set()
    assert [(c.args["outcome"], c.result) for c in runtime.transport.of("finish")] == [("cancelled", "cancelled")]
    assert fresh(job).state == JobState.CANCELLED
    assert [a.state for a in attempts_of(job)] == [AttemptState.CANCELLED]


def test_a_stale_token_is_refused_on_heartbeat_and_finish_and_the_runtime_discards_the_result(make_runtime, clock):
    job = enqueue()
    executor, runtime = running_held_job(make_runtime)
    [claim] = runtime.transport.of("claim")[0].result
    raw = runtime.transport.inner  # calls the test makes itself, not recorded as the runtime's

    # A token that is not the attempt's.
    with pytest.raises(StaleAttempt):
        raw.heartbeat(attempt_id=claim.attempt_id, token="not-" + claim.token)
    with pytest.raises(StaleAttempt):
        raw.finish(attempt_id=claim.attempt_id, token="not-" + claim.token, outcome="succeeded", summary={}, error=None)
    assert fresh(job).state == JobState.LEASED

    # The attempt's own token, once its lease ran out and the reaper requeued the job.
    clock.advance(LEASE + 1)
    assert [a.pk for a in services.leases_expire()] == [claim.attempt_id]
    with pytest.raises(StaleAttempt):
        raw.heartbeat(attempt_id=claim.attempt_id, token=claim.token)
    with pytest.raises(StaleAttempt):
        raw.finish(attempt_id=claim.attempt_id, token=claim.token, outcome="succeeded", summary={}, error=None)

    # The runtime learns it from its next heartbeat: the runner stops and nothing is sent.
    tick(runtime)
    runtime.heartbeat_once()
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the runner to be stopped")
    runtime.reap(wait=True)
    [beat] = runtime.transport.of("heartbeat")
    assert isinstance(beat.error, StaleAttempt)
    assert runtime.transport.of("finish") == []
    assert runtime.finished_count == 0 and runtime.fatal is None

    job = fresh(job)
    assert (job.state, job.current_attempt_id, job.summary) == (JobState.QUEUED, None, {})
    assert [a.state for a in attempts_of(job)] == [AttemptState.EXPIRED]


def test_registering_the_same_worker_id_again_supersedes_the_old_session_and_its_runtime_stops_fatally(
    make_runtime, make_transport
):
    job = enqueue()
    executor, runtime = running_held_job(make_runtime)
    [claim] = runtime.transport.of("claim")[0].result
    old, session = runtime.transport.inner, runtime.session

    newer = make_transport("w1").register(spec("w1"))  # another process with the same worker id
    assert fresh(job).state == JobState.QUEUED  # its registration expired what the old session held

    old_calls = {
        "worker heartbeat": lambda: old.worker_heartbeat(session=session, draining=False, ready=True),
        "claim": lambda: old.claim(session=session, max_jobs=1, wait=0),
        "attempt heartbeat": lambda: old.heartbeat(attempt_id=claim.attempt_id, token=claim.token),
        "finish": lambda: old.finish(
            attempt_id=claim.attempt_id, token=claim.token, outcome="succeeded", summary={}, error=None
        ),
    }
    assert {name: error_of(call) for name, call in old_calls.items()} == dict.fromkeys(old_calls, SessionSuperseded)

    tick(runtime)
    runtime.heartbeat_once()
    assert runtime.fatal and "another process registered" in runtime.fatal
    assert runtime.stopped.is_set()
    with runtime.lock:
        jobs = list(runtime.active.values())
    assert [bool(j.discard) for j in jobs] == [True]
    wait_for(executor.cancelled.is_set, timeout=WAIT, what="the runner to be stopped")
    assert runtime.run() == 1  # fatal: the loop does not start again
    assert runtime.idle() and runtime.claim_once() == 0

    assert runtime.transport.of("finish") == []
    assert fresh(job).state == JobState.QUEUED
    assert [a.state for a in attempts_of(job)] == [AttemptState.EXPIRED]
    assert Worker.objects.get(pk="w1").session == newer.session


def test_an_operator_drain_reaches_the_worker_on_its_next_heartbeat_and_it_finishes_its_job_then_exits_unready(
    make_runtime,
):
    job = enqueue()
    executor, runtime = running_held_job(make_runtime)

    services.worker_drain(worker_id="w1")
    later = enqueue()
    assert not runtime.draining.is_set()  # nothing told the worker yet
    tick(runtime)
    runtime.heartbeat_once()
    assert runtime.transport.of("worker_heartbeat")[-1].result is True
    assert runtime.draining.is_set()
    assert runtime.claim_once() == 0

    exit_code = {}

    def main():  # the worker process's main thread
        try:
            exit_code["code"] = runtime.run()
        finally:
            connection.close()  # the in-process transport's connection of this thread

    loop = threading.Thread(target=main, daemon=True)
    loop.start()
    executor.release.set()
    loop.join(timeout=WAIT)
    assert not loop.is_alive(), "the drained runtime did not exit"
    assert exit_code["code"] == 0
    assert not executor.cancelled.is_set()

    # Its active job was finished first, then it reported ready: false; it claimed nothing more.
    calls = runtime.transport.calls
    assert [c.name for c in calls[-2:]] == ["finish", "worker_heartbeat"]
    assert calls[-2].result == JobState.SUCCEEDED
    assert calls[-1].args["ready"] is False and calls[-1].args["draining"] is True
    assert len(runtime.transport.of("claim")) == 1
    assert fresh(job).state == JobState.SUCCEEDED
    assert fresh(later).state == JobState.QUEUED
    worker = Worker.objects.get(pk="w1")
    assert (worker.ready, worker.draining, worker.drain_requested) == (False, True, True)


def test_an_undelivered_finish_in_the_outbox_is_delivered_on_the_next_start_and_a_stale_one_is_dropped(
    make_runtime, clock, tmp_path
):
    delivered, stale = enqueue(), enqueue()
    outbox = LocalDB(tmp_path / "w1.db")
    first = make_runtime(FakeExecutor("succeeded"), capacity=2, outbox=outbox)
    first.transport.finish_down = True  # the first send of each finish fails
    assert first.claim_once() == 2
    wait_for(lambda: len(outbox.pending()) == 2, timeout=WAIT, what="both finishes in the outbox")
    wait_for(
        lambda: {c.args["attempt_id"] for c in first.transport.of("finish")} >= {e["attempt_id"] for e in outbox.pending()},
        timeout=WAIT,
        what="a failed send of each finish",
    )
    crash(first)  # the process dies with both finishes undelivered
    assert all(isinstance(c.error, TransportError) for c in first.transport.of("finish"))
    claims = {c.job_id: c for c in first.transport.of("claim")[0].result}

    # One attempt's lease was extended before the crash, the other's ran out and was requeued.
    clock.advance(LEASE - 5)
    first.transport.inner.heartbeat(attempt_id=claims[delivered.pk].attempt_id, token=claims[delivered.pk].token)
    clock.advance(10)
    assert [a.pk for a in services.leases_expire()] == [claims[stale.pk].attempt_id]

    second = make_runtime(FakeExecutor(), capacity=2, outbox=outbox)  # the next start: same id, same outbox

    assert outbox.pending() == []
    with contextlib.closing(sqlite3.connect(tmp_path / "w1.db")) as db:
        answers = dict(db.execute("SELECT job_id, answer FROM finish_outbox WHERE acked_at IS NOT NULL"))
    assert answers == {delivered.pk: JobState.SUCCEEDED, stale.pk: "stale"}
    # Delivered before registering (which would expire the old session's attempts).
    assert [c.name for c in second.transport.calls] == ["finish", "finish", "register"]
    finishes = {c.args["attempt_id"]: c for c in second.transport.of("finish")}
    assert finishes[claims[delivered.pk].attempt_id].result == JobState.SUCCEEDED
    assert isinstance(finishes[claims[stale.pk].attempt_id].error, StaleAttempt)
    assert second.registration is not None

    assert fresh(delivered).state == JobState.SUCCEEDED
    assert fresh(delivered).summary == {"ran": delivered.pk}
    assert fresh(stale).state == JobState.QUEUED
    assert [a.state for a in attempts_of(stale)] == [AttemptState.EXPIRED]
    outbox.close()


def test_a_claimed_job_whose_executor_succeeds_ends_succeeded_after_exactly_one_attempt(make_runtime):
    job = enqueue()
    executor = FakeExecutor("succeeded")
    runtime = make_runtime(executor)

    assert runtime.claim_once() == 1
    runtime.reap(wait=True)

    assert [c.job_id for c in executor.claims] == [job.pk]
    assert [(c.args["outcome"], c.result) for c in runtime.transport.of("finish")] == [("succeeded", "succeeded")]
    assert runtime.finished_count == 1 and runtime.idle()
    job = fresh(job)
    assert (job.state, job.summary, job.attempt_count) == (JobState.SUCCEEDED, {"ran": job.pk}, 1)
    [attempt] = attempts_of(job)
    assert attempt.state == AttemptState.SUCCEEDED
    assert runtime.claim_once() == 0  # nothing left to claim


def test_the_journal_is_written_and_read_through_the_attempt_and_a_checkpoint_rides_a_heartbeat(make_transport, clock):
    """record/records/heartbeat(checkpoint=…) behave the same over both transports
    (jobqueue/services/records.py says the rules)."""
    job = enqueue()
    transport = make_transport("w1")
    session = transport.register(spec("w1")).session
    [claim] = transport.claim(session=session, max_jobs=1, wait=0)
    fence = {"attempt_id": claim.attempt_id, "token": claim.token}

    started = transport.record(**fence, key="publish:open-pr", state="started", value={})
    assert (started.key, started.state, started.attempt_number, started.started_by) == ("publish:open-pr", "started", 1, 1)
    assert not started.started_earlier and not started.already_done
    done = transport.record(**fence, key="publish:open-pr", state="done", value={"output": "https://example/pr/1"})
    assert (done.state, done.value, done.already_done) == ("done", {"output": "https://example/pr/1"}, False)
    again = transport.record(**fence, key="publish:open-pr", state="started", value={})
    assert again.already_done and again.value == {"output": "https://example/pr/1"}

    clock.advance(1)
    beat = transport.heartbeat(**fence, checkpoint=("implement", "session 42, turn 3"))
    assert beat.lease_expires_at == in_seconds(clock, LEASE) and beat.cancel is False
    assert transport.heartbeat(**fence).lease_expires_at == in_seconds(clock, LEASE)  # old callers: no checkpoint

    journal = transport.records(**fence)
    assert [(r.key, r.state, r.value) for r in journal] == [
        ("publish:open-pr", "done", {"output": "https://example/pr/1"}),
        ("checkpoint:implement", "started", {"content": "session 42, turn 3"}),
    ]
    assert error_of(lambda: transport.record(**fence, key="k", state="finished", value={})) is InvalidRequest
    assert error_of(lambda: transport.heartbeat(**fence, checkpoint=("not a step id", "x"))) is InvalidRequest

    transport.finish(**fence, outcome="succeeded", summary={}, error=None)
    assert error_of(lambda: transport.record(**fence, key="late", state="done", value={})) is StaleAttempt
    assert error_of(lambda: transport.records(**fence)) is StaleAttempt
    assert error_of(lambda: transport.heartbeat(**fence, checkpoint=("implement", "late"))) is StaleAttempt
    assert set(services.records_of_job(job.pk)) == {"publish:open-pr", "checkpoint:implement"}


def test_a_full_checkpoint_of_characters_json_escapes_is_read_back(make_transport, clock):
    """A checkpoint at its cap (MAX_CHECKPOINT_BYTES of UTF-8) is larger than a record's value cap
    once JSON escapes it; the worker's check of the journal answer still takes it, or no attempt
    after a crash could read its journal."""
    from jobqueue.types import MAX_CHECKPOINT_BYTES

    enqueue()
    transport = make_transport("w1")
    session = transport.register(spec("w1")).session
    [claim] = transport.claim(session=session, max_jobs=1, wait=0)
    fence = {"attempt_id": claim.attempt_id, "token": claim.token}
    content = "\x01" * MAX_CHECKPOINT_BYTES  # each one "\u0001" (6 bytes) in JSON
    transport.heartbeat(**fence, checkpoint=("agent", content))
    [record] = transport.records(**fence)
    assert (record.key, record.value) == ("checkpoint:agent", {"content": content})


class JournalExecutor:
    """An executor that uses its journal as the workflow executor does: reads it, records a
    publish's start, points its checkpoint slot at a file, then holds; once released it
    records the publish done (which a stale attempt cannot)."""

    def __init__(self, checkpoint_file):
        self.file = checkpoint_file
        self.release = threading.Event()
        self.started = threading.Event()
        self.seen: dict = {}
        self.error: JournalError | None = None

    def run(self, claim, cancel, *, grace, journal) -> Outcome:
        try:
            self.seen = journal.records()
            journal.record("publish:open-pr", "started", {})
            self.file.write_text("session 42, turn 3")
            journal.checkpoint = Checkpoint("implement", self.file)
            self.started.set()
            self.release.wait(WAIT)
            journal.record("publish:open-pr", "done", {"output": "https://example/pr/1"})
        except JournalError as exc:
            self.error = exc
            return Outcome("failed", {}, str(exc))
        return Outcome("succeeded", {})


def test_the_runtime_gives_the_executor_its_jobs_journal_and_heartbeats_carry_its_checkpoint(make_runtime, tmp_path, clock):
    """Over both transports: the executor's journal writes through the claim's attempt, a changed
    checkpoint file rides the next heartbeat once (an unchanged one is not resent), and a journal
    write refused as stale discards the job's result, as a stale heartbeat does."""
    job = enqueue()
    executor = JournalExecutor(tmp_path / "checkpoint")
    runtime = make_runtime(executor)
    assert runtime.claim_once() == 1
    wait_for(executor.started.is_set, timeout=WAIT, what="the executor to hold")

    tick(runtime)
    runtime.heartbeat_once()
    tick(runtime)
    runtime.heartbeat_once()
    sent = [c.args.get("checkpoint") for c in runtime.transport.of("heartbeat")]
    assert sent == [("implement", "session 42, turn 3"), None]

    clock.advance(LEASE + 1)
    services.leases_expire()  # the worker paused past its lease
    executor.release.set()
    runtime.reap(wait=True)

    assert executor.seen == {} and executor.error is not None and not executor.error.current
    assert runtime.transport.of("finish") == []  # the stale write discarded the result: no finish sent
    records = services.records_of_job(job.pk)
    assert {key: (r.state, r.value) for key, r in records.items()} == {
        "publish:open-pr": ("started", {}),
        "checkpoint:implement": ("started", {"content": "session 42, turn 3"}),
    }


class LoggingExecutor:
    """Writes a step's log as the workflow executor does: it tells the journal's log sender where
    the step's output begins (the file holds an earlier attempt's output), writes a line (and
    says so, as the runner does), holds until released, writes its last line and ends the step."""

    def __init__(self, path):
        self.path = path
        self.started = threading.Event()
        self.release = threading.Event()

    def run(self, claim, cancel, *, grace, journal=None) -> Outcome:
        self.path.write_text("an earlier attempt's output\n")
        journal.logs.step_started("plan", self.path)
        with self.path.open("a") as log:
            log.write("first line: é\n")
        journal.logs.output_written()
        self.started.set()
        while not self.release.is_set():
            if cancel.wait(0.01):
                return Outcome("cancelled", {})
        with self.path.open("a") as log:
            log.write("last line\n")
        journal.logs.output_written()
        journal.logs.step_ended("plan")
        return Outcome("succeeded", {})


def sent_text(runtime) -> str:
    """The log text the control plane took, as the runtime's calls and their answers show it."""
    return "".join(c.args["text"] for c in list(runtime.transport.of("log_append")) if c.result is not None and c.result.stored)


def logging_runtime(make_runtime, tmp_path, *, answers_lost: int = 0):
    executor = LoggingExecutor(tmp_path / "plan.log")
    runtime = make_runtime(executor)
    runtime.log_interval = 0.01
    runtime.transport.log_answers_lost = answers_lost
    assert runtime.claim_once() == 1
    wait_for(executor.started.is_set, timeout=WAIT, what="the step to start")
    return executor, runtime


def test_a_running_steps_output_reaches_the_control_plane_before_the_step_ends_and_all_of_it_before_the_finish(
    make_runtime, tmp_path
):
    job = enqueue()
    executor, runtime = logging_runtime(make_runtime, tmp_path)
    wait_for(lambda: "first line" in sent_text(runtime), timeout=WAIT, what="the running step's first line")
    assert not executor.release.is_set()  # the step is still running

    executor.release.set()
    runtime.reap(wait=True)
    names = [c.name for c in runtime.transport.calls]
    last_chunk = max(i for i, name in enumerate(names) if name == "log_append")
    assert last_chunk < names.index("finish")  # a finished attempt takes no more chunks
    assert runtime.transport.of("log_append")[-1].args["final"] is True
    log = log_read(job_id=job.pk, attempt_number=1, stream="plan")
    assert (log.text, log.ended) == ("first line: é\nlast line\n", True)  # not the earlier attempt's output
    assert fresh(job).state == JobState.SUCCEEDED


def test_a_log_chunk_whose_answer_was_lost_is_sent_again_and_stored_once(make_runtime, tmp_path):
    job = enqueue()
    executor, runtime = logging_runtime(make_runtime, tmp_path, answers_lost=1)
    answered = lambda: [c for c in list(runtime.transport.of("log_append")) if c.result is not None]  # noqa: E731
    wait_for(answered, timeout=WAIT, what="the chunk sent again")
    first, again = runtime.transport.of("log_append")[:2]
    assert isinstance(first.error, TransportError) and again.args == first.args
    assert again.result.stored is False  # the first one was stored: the resend adds nothing
    executor.release.set()
    runtime.reap(wait=True)
    assert log_read(job_id=job.pk, attempt_number=1, stream="plan").text == "first line: é\nlast line\n"


def test_a_stale_answer_stops_the_log_sender(make_runtime, tmp_path, clock):
    job = enqueue()
    executor, runtime = logging_runtime(make_runtime, tmp_path)
    wait_for(lambda: "first line" in sent_text(runtime), timeout=WAIT, what="the first line")
    [active] = runtime.active.values()

    clock.advance(LEASE + 1)
    services.leases_expire()  # the worker paused past its lease: another worker may run the job now
    with executor.path.open("a") as log:
        log.write("written after the lease ran out\n")
    wait_for(active.logs.stopped.is_set, timeout=WAIT, what="the log sender to stop")
    refused = [c for c in runtime.transport.of("log_append") if c.error is not None]
    assert [type(c.error) for c in refused] == [StaleAttempt]  # one refusal, then nothing more is sent
    crash(runtime)
    assert log_read(job_id=job.pk, attempt_number=1, stream="plan").text == "first line: é\n"
