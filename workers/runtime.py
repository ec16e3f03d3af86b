"""The worker runtime: one loop for the embedded worker and for remote ones.

Threads:
* the claim loop (`run`): claims up to free capacity (long-polling through the
  transport), starts one thread per job, and ends the loop once drained. A
  claim that fails for want of the control plane (unreachable, a 503) backs
  the loop off (`claim_backoff`: capped exponential backoff with full jitter,
  never sooner than a 503's Retry-After, reset by the next success); this is
  the claims' only retry layer, since the transport sends a claim once;
* the heartbeat loop: worker heartbeats (which carry the operator's drain
  request back) and one heartbeat per active attempt every
  `heartbeat_interval`; a `cancel` answer, a stale attempt or a lease that
  must have passed stops that job's runner;
* a thread per job, running the executor and then sending the finish; where
  the transport can claim in the finish's commit (the in-process one's
  `finish_and_claim`), the first try of a finish claims the thread's next
  job too (not while draining), and the thread runs that one next, started
  as `claim_once` starts a claim (`_start`): heartbeated and fenced alike;
* a log sender per job (workers/logstream.py), on a thread of its own from
  a step's first output, streaming the steps' output to the control plane;
  the job's finish waits for it (at most LOG_FLUSH_WAIT), since the finished
  attempt takes no more (in the embedded worker the finish carries the final
  chunks of quiet steps, and the sender thread's own are queued to commit
  ahead of the finish instead of waited for).

Heartbeats do not back off: one try each, and the next round beats again at
the heartbeat cadence, because leases depend on them.

Self-fencing: the worker never trusts its attempt past the lease. It measures,
on its own monotonic clock, from the *sending* time of the last heartbeat the
control plane acknowledged (or of the claim), plus lease_duration, minus a
margin; past that the control plane may already have given the job to another
worker, so the runner is stopped and the result discarded. Likewise a worker
that has not reached the control plane for half a lease stops claiming.
"""

import dataclasses
import logging
import random
import threading
import time

from jobqueue.exceptions import QueueError
from jobqueue.types import Claim

from .backoff import Backoff
from .executor import Executor, Outcome
from .jobthreads import JobThreads, Run
from .journal import Journal
from .logstream import LogSender
from .transport import Registration, Transport, TransportError, WorkerSpec
from .verdicts import FATAL, Verdict, classify

log = logging.getLogger("apiary.worker")

CLAIM_BACKOFF = {"base": 0.5, "cap": 20.0}  # seconds: the claim loop's, while the control plane is unavailable
FINISH_BACKOFF = {"base": 0.2, "cap": 5.0}  # seconds: a job thread's, resending its finish
SLOT_WAIT = 1.0  # seconds the claim loop waits at most for a job to end before it looks again
LOG_FLUSH_WAIT = 5.0  # seconds a finish waits for the job's log sender to send its steps' last output


@dataclasses.dataclass
class ActiveJob:
    claim: Claim
    acked_at: float  # monotonic sending time of the last acknowledged claim/heartbeat
    next_heartbeat: float
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    discard: str | None = None  # why the result must not be sent
    thread: Run | None = None  # its run on one of the worker's job threads
    outbox_id: int | None = None  # the finish's row in the worker's outbox, once written
    journal: Journal | None = None  # what the executor records through; its checkpoint rides the heartbeats
    finishing: bool = False  # its finish is being sent: a stale heartbeat answer may just mean it landed
    logs: LogSender | None = None  # streams its steps' output, when the control plane takes logs


class WorkerRuntime:
    def __init__(
        self,
        *,
        transport: Transport,
        spec: WorkerSpec,
        executor: Executor,
        claim_wait: float = 1.0,
        grace: float = 5.0,
        fence_margin: float | None = None,
        outbox=None,
        monotonic=time.monotonic,
        sleep=time.sleep,
        wait=None,
        rand=random.random,
        exit_on_drain: bool = True,
        log_interval: float = 0.5,
    ):
        self.transport = transport
        self.spec = spec
        self.executor = executor
        self.claim_wait = claim_wait
        self.grace = grace  # SIGTERM → SIGKILL of a stopped step; clamped to the lease at start()
        self.fence_margin = fence_margin
        self.outbox = outbox  # workers.localdb.LocalDB for remote workers: finishes survive restarts
        self.monotonic = monotonic  # the worker's own clock for self-fencing; tests pass a fake one
        self.wake = threading.Event()  # set on drain and stop: ends the claim loop's backoff wait early
        self.freed = threading.Event()  # set when a job ends (and on drain and stop): the claim loop claims again
        self.job_threads = JobThreads()
        self.sleep = sleep  # a job thread's wait between finish attempts; tests pass a fake one
        # The claim loop's wait while backing off, which a drain or a stop ends early; tests pass a fake one.
        self.wait = wait or self.wake.wait
        self.rand = rand  # uniform in [0, 1): every jitter; tests pass a fixed one
        self.claim_backoff = Backoff(**CLAIM_BACKOFF, rand=rand)
        self.claim_delay = 0.0  # what the claim loop waits before its next call: > 0 only while backing off
        # A remote worker exits once drained; the embedded one only pauses while
        # an operator's drain stands, and resumes when it is lifted.
        self.exit_on_drain = exit_on_drain
        self.log_interval = log_interval  # seconds between a log sender's looks at a running step's log
        self.shutting_down = False
        self.stopping_runners = False  # cancel_all: a job started from here on is stopped at once
        self.paused_by_operator = False
        self.registration: Registration | None = None
        self.active: dict[int, ActiveJob] = {}
        self.lock = threading.Lock()
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self.fatal: str | None = None
        self.last_contact = 0.0
        self.next_worker_heartbeat = 0.0
        self.finished_count = 0
        # The transport's finish that claims, and carries the job's last writes (InProcessTransport's);
        # a remote worker's outbox resends plain finishes after a restart, so it has none.
        self.finish_and_claim = getattr(transport, "finish_and_claim", None) if outbox is None else None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Registration:
        # Finishes a previous process could not deliver go first: registering
        # expires the attempts the old session still holds, so this does not
        # register while any of them is still undelivered (TransportError).
        if self.flush_outbox():
            raise TransportError("finishes from a previous run are not delivered yet; not registering")
        self.registration = self.transport.register(self.spec)
        longest = self.registration.lease_duration / 4
        if self.grace > longest:
            log.warning(
                "grace %.1fs is too long for a %.1fs lease: using %.1fs, so a self-fenced step is killed in time",
                self.grace, self.registration.lease_duration, longest,
            )
            self.grace = longest
        self.last_contact = self.monotonic()
        self.next_worker_heartbeat = self.last_contact + self.registration.heartbeat_interval
        log.info(
            "worker %s registered (pool=%s, capacity=%s, capabilities=%s)",
            self.spec.worker_id, self.spec.pool, self.spec.capacity, ",".join(self.spec.capabilities),
        )
        return self.registration

    @property
    def session(self) -> str:
        assert self.registration is not None, "start() first"
        return self.registration.session

    @property
    def margin(self) -> float:
        lease = self.registration.lease_duration
        return self.fence_margin if self.fence_margin is not None else min(2.0, lease * 0.1)

    @property
    def fence_after(self) -> float:
        """Seconds after the sending time of the last acknowledged heartbeat at
        which a runner is stopped: the lease, less the margin, less the grace a
        step gets between SIGTERM and SIGKILL — so it is dead before the lease ends."""
        return self.registration.lease_duration - self.margin - self.grace

    @property
    def beat_every(self) -> float:
        """Attempt heartbeats at the configured interval, but at least twice per
        fence window: a heartbeat_interval close to the lease would otherwise
        fence every job longer than it."""
        return max(0.05, min(self.registration.heartbeat_interval, self.fence_after / 2))

    def request_drain(self, why: str = "drain requested") -> None:
        """Stop claiming, let active jobs finish, then stop (a signal, a shutdown)."""
        self.shutting_down = True
        self._drain(why)

    def _operator_drain(self, requested: bool) -> None:
        if requested and not self.draining.is_set():
            self.paused_by_operator = not self.exit_on_drain
            self._drain("an operator asked this worker to drain")
        elif not requested and self.paused_by_operator and not self.shutting_down:
            self.paused_by_operator = False
            self.draining.clear()
            self.wake.clear()
            log.info("worker %s: drain lifted by an operator; claiming again", self.spec.worker_id)
            self._call(self._send_worker_heartbeat)  # tell the control plane at once: it refuses claims while draining
            self.freed.set()  # the claim loop's wait ends now, not at its next look

    def _drain(self, why: str) -> None:
        if not self.draining.is_set():
            log.info("worker %s draining (%s): no new claims; %d active job(s) will finish", self.spec.worker_id, why, len(self.active))
            self.draining.set()
            self.wake.set()
            self.freed.set()

    def cancel_all(self, why: str = "worker stopping") -> None:
        """A second signal: stop every runner; the jobs finish as `cancelled`."""
        self.request_drain(why)
        with self.lock:
            self.stopping_runners = True  # a job claimed with a finish already under way is stopped too
            jobs = list(self.active.values())
        for job in jobs:
            log.info("stopping job %s attempt %s (%s)", job.claim.job_id, job.claim.attempt_id, why)
            job.cancel.set()

    def idle(self) -> bool:
        with self.lock:
            return not self.active

    def full(self) -> bool:
        with self.lock:
            return len(self.active) >= self.spec.capacity

    def run(self) -> int:
        """Claim and run jobs until drained (or a fatal error); returns an exit code."""
        if self.registration is None:
            self.start()
        beat = threading.Thread(target=self._heartbeat_loop, name=f"{self.spec.worker_id}-heartbeat", daemon=True)
        beat.start()
        fence = threading.Thread(target=self._fence_loop, name=f"{self.spec.worker_id}-fence", daemon=True)
        fence.start()
        try:
            while not self.stopped.is_set():
                self.freed.clear()  # before looking: a job that ends from here on wakes the waits below
                self.reap()
                if self.draining.is_set():
                    if self.idle() and (self.exit_on_drain or self.shutting_down):
                        break
                    self.freed.wait(SLOT_WAIT)
                    continue
                if self.full():  # no capacity to claim with: wait for a job to end, not on a timer
                    self.freed.wait(SLOT_WAIT)
                    continue
                try:
                    claimed = self.claim_once(wait=self.claim_wait)
                except QueueError as exc:  # refused as malformed (an HTTP 500, an answer not protocol v1): it says why
                    delay = self._claim_failed(exc)
                    log.error("worker %s: claim failed (%s); claiming again in %.2fs", self.spec.worker_id, exc, delay)
                    claimed = 0
                except Exception as exc:  # an answer we did not expect: keep the worker (and its runners) alive
                    delay = self._claim_failed(exc)
                    log.exception("worker %s: claim failed; claiming again in %.2fs", self.spec.worker_id, delay)
                    claimed = 0
                if self.claim_delay > 0:  # backing off: wait the delay the log line named, once
                    delay, self.claim_delay = self.claim_delay, 0.0
                    self.wait(delay)
                elif not claimed:
                    time.sleep(0.05 + self.rand() * 0.05)  # no lockstep between workers
        finally:
            self.stopped.set()
            beat.join(timeout=5)
            fence.join(timeout=5)
        self.reap(wait=True)
        if self.fatal is None:
            try:
                self._send_worker_heartbeat(ready=False)
            except (QueueError, OSError) as exc:  # drained all the same; the control plane will see it stale
                log.warning("worker %s: could not report ready: false (%s)", self.spec.worker_id, exc)
            log.info("worker %s drained; %d job(s) finished", self.spec.worker_id, self.finished_count)
            return 0
        log.error("worker %s stopped: %s", self.spec.worker_id, self.fatal)
        return 1

    # ------------------------------------------------------------------ claiming

    def reachable(self) -> bool:
        return self.monotonic() - self.last_contact < self.registration.lease_duration / 2

    def claim_once(self, *, wait: float = 0.0) -> int:
        """Claim up to free capacity; returns how many jobs were started.

        A call that fails for want of the control plane (a claim, or the worker
        heartbeat that probes a control plane not reached for half a lease)
        counts in `claim_backoff` and sets `claim_delay`, which `run` waits
        out before it calls this again; a success resets both."""
        free = self.spec.capacity - len(self.active)
        if free <= 0 or self.draining.is_set() or self.stopped.is_set():
            return 0
        if not self.reachable():
            self._claim_call("reaching the control plane", self._send_worker_heartbeat)  # claim next time
            return 0
        sent = self.monotonic()
        claims = self._claim_call(
            "claim", lambda: self.transport.claim(session=self.session, max_jobs=free, wait=wait)
        ) or []
        # The lease started somewhere between sending and receiving. After a
        # long poll that could be long ago, so such a claim is confirmed with a
        # heartbeat (a fresh, known starting point) before its runner starts.
        late = self.monotonic() - sent > self.margin / 2
        for claim in claims:
            self._start(claim, sent, late)
        return len(claims)

    def _start(
        self, claim: Claim, sent: float, late: bool, *, thread: Run | None = None, replaces: int | None = None
    ) -> ActiveJob | None:
        """Make a claim an active job: confirmed first when `late`, with its journal and log
        sender, on a job thread of its own, or, given `thread`, on that one (the job thread
        that claimed it with the finish of job `replaces`, which runs it next). None when the
        claim is already stale, or the worker stopped meanwhile: nothing would heartbeat it,
        so its lease runs out and it is claimed again."""
        acked = sent
        if late:
            confirmed = self._confirm(claim)
            if confirmed is None:
                return None
            acked = confirmed
        job = ActiveJob(claim=claim, acked_at=acked, next_heartbeat=acked + self.beat_every)
        # A control plane from before the journal (no `journal` feature) keeps none: the executor
        # then refuses publish and spawn steps and runs the rest as before.
        job.journal = self._journal(job) if "journal" in self.registration.features else None
        if job.journal is not None and "logs" in self.registration.features:
            job.logs = job.journal.logs = LogSender(
                transport=self.transport, claim=claim, interval=self.log_interval, rand=self.rand,
                threads=self.job_threads, defer_final=True,  # _run_job finishes the job once it is closed
                carry_final=self.finish_and_claim is not None,
            )
        with self.lock:  # against _fatal's and cancel_all's look at the active jobs
            if self.fatal is not None or self.stopped.is_set():
                log.warning("job %s attempt %s claimed as the worker stopped: its lease runs out", claim.job_id, claim.attempt_id)
                return None
            log.info(
                "claim: job %s attempt %s (#%s) agent %s runner %s",
                claim.job_id, claim.attempt_id, claim.attempt_number, claim.agent, claim.runner,
            )
            if replaces is not None:
                self.active.pop(replaces, None)  # its slot is this job's: the worker is never over capacity
            self.active[claim.attempt_id] = job
            if self.stopping_runners:
                job.cancel.set()
            if thread is not None:
                job.thread = thread
                return job
            try:
                job.thread = self.job_threads.start(lambda job=job: self._run_job(job), f"job-{claim.job_id}")
            except BaseException:  # no thread (the OS refused one): the slot is free, the lease runs out
                del self.active[claim.attempt_id]
                raise
        return job

    def _claim_call(self, what: str, fn):
        """A call of the claim loop. Success resets the backoff; a transient
        failure is logged with the true wait before the next one and answered
        None; a superseded session or a refused token is fatal."""
        try:
            result = fn()
        except QueueError as exc:
            verdict = classify(exc)
            if verdict in FATAL:
                self._stop_for(verdict, exc)
                return None
            if verdict is not Verdict.RETRY:
                raise
            delay = self._claim_failed(exc)
            log.warning(
                "worker %s: %s failed (%s); claiming again in %.2fs (%d failure(s) in a row)",
                self.spec.worker_id, what, exc, delay, self.claim_backoff.failures,
            )
            return None
        self.claim_backoff.succeeded()
        self.claim_delay = 0.0
        self.last_contact = self.monotonic()
        return result

    def _claim_failed(self, exc: Exception) -> float:
        """Back the claim loop off after `exc`; the seconds until it claims again."""
        self.claim_delay = self.claim_backoff.failed(getattr(exc, "retry_after", None))
        return self.claim_delay

    def _confirm(self, claim: Claim) -> float | None:
        """Heartbeat a just-claimed attempt; the sending time when acknowledged,
        the claim's own sending time (the safe side) on a transient failure, None when stale."""
        sent = self.monotonic()
        try:
            self.transport.heartbeat(attempt_id=claim.attempt_id, token=claim.token)
        except QueueError as exc:
            verdict = classify(exc)
            if verdict is Verdict.RETRY:
                return sent - self.fence_after  # unconfirmed: the fence treats it as already due
            if verdict in FATAL:
                self._stop_for(verdict, exc)
            log.warning("claim of job %s attempt %s is already stale: %s", claim.job_id, claim.attempt_id, exc.message)
            return None
        return sent

    def _journal(self, job: ActiveJob) -> Journal:
        """The job's journal: a call refused as stale discards the job's result, as a stale
        heartbeat does; a superseded session or a refused credential stops the worker."""

        def refused(verdict: Verdict, exc: QueueError) -> None:
            if verdict in FATAL:
                self._stop_for(verdict, exc)
            else:
                self._discard(job, f"the control plane refused a journal write as stale: {exc.message}")

        return Journal(
            transport=self.transport, claim=job.claim, cancel=job.cancel, on_refused=refused, rand=self.rand,
            finish_carries=self.finish_and_claim is not None,  # _run_job's finish carries the job's last record
        )

    def reap(self, wait: bool = False) -> None:
        with self.lock:
            jobs = list(self.active.items())
        for attempt_id, job in jobs:
            if wait:
                job.thread.join()
            if not job.thread.is_alive():
                with self.lock:
                    self.active.pop(attempt_id, None)

    # ------------------------------------------------------------------ heartbeats

    def _heartbeat_loop(self) -> None:
        tick = min(0.2, self.registration.heartbeat_interval / 4)
        try:
            while not self.stopped.is_set():
                try:
                    self.heartbeat_once()
                except Exception:  # keep beating: a dead heartbeat thread would let every lease run out
                    log.exception("worker %s: heartbeat round failed", self.spec.worker_id)
                self.stopped.wait(tick)
        finally:
            self.transport.close()  # this thread's database connection (in-process transport)

    def heartbeat_once(self) -> None:
        now = self.monotonic()
        if now >= self.next_worker_heartbeat:
            self.next_worker_heartbeat = now + self.registration.heartbeat_interval
            drain = self._call(self._send_worker_heartbeat)
            if drain is not None:
                self._operator_drain(drain)
        with self.lock:
            jobs = list(self.active.values())
        for job in jobs:
            self._beat(job)

    def _send_worker_heartbeat(self, *, ready: bool = True) -> bool:
        drain = self.transport.worker_heartbeat(session=self.session, draining=self.draining.is_set(), ready=ready)
        self.last_contact = self.monotonic()
        return drain

    def _fence_loop(self) -> None:
        """Self-fencing on a thread of its own, which never waits on the
        network: the heartbeat thread can hang in a request for as long as
        the read timeout (a partition answers nothing, not even an error),
        and a hung request must not keep a runner alive past its lease."""
        while not self.stopped.is_set():
            with self.lock:
                jobs = list(self.active.values())
            for job in jobs:
                self._fence(job)
            self.stopped.wait(0.05)

    def _fence(self, job: ActiveJob) -> bool:
        """Stop the job's runner once its lease must have passed; True when fenced (now or before)."""
        if job.discard:
            return True
        if job.thread is None or not job.thread.is_alive():
            return False
        if self.monotonic() >= job.acked_at + self.fence_after:
            self._discard(job, "its lease must have run out without an acknowledged heartbeat (self-fenced)")
            return True
        return False

    def _beat(self, job: ActiveJob) -> None:
        now = self.monotonic()
        if job.discard or job.thread is None or not job.thread.is_alive():
            return
        if self._fence(job):
            return
        if now < job.next_heartbeat:
            return
        job.next_heartbeat = now + self.beat_every
        checkpoint = job.journal.pending_checkpoint() if job.journal is not None else None
        try:
            answer = self.transport.heartbeat(
                attempt_id=job.claim.attempt_id, token=job.claim.token,
                **({"checkpoint": checkpoint} if checkpoint is not None else {}),
            )
        except QueueError as exc:
            verdict = classify(exc)
            if verdict is Verdict.RETRY:
                log.warning("heartbeat of attempt %s failed (%s); retrying", job.claim.attempt_id, exc)
                job.next_heartbeat = now + min(1.0, self.beat_every / 2)
            elif verdict in FATAL:
                self._stop_for(verdict, exc)
            elif verdict is Verdict.REFUSED and checkpoint is not None:
                # The checkpoint, not the attempt, was refused (a control plane before checkpoints):
                # it is dropped, and the lease is extended at once without it.
                log.warning("heartbeat of attempt %s: checkpoint refused (%s); beating without it", job.claim.attempt_id, exc)
                job.journal.checkpoint_sent(checkpoint)
                job.next_heartbeat = now
            elif job.finishing:  # the finish committed before this heartbeat: nothing to stop
                log.debug("heartbeat of attempt %s answered stale while its finish is sent", job.claim.attempt_id)
            else:
                self._discard(job, f"the control plane says the attempt is stale: {exc.message}")
            return
        job.acked_at = now
        self.last_contact = self.monotonic()
        if checkpoint is not None:
            job.journal.checkpoint_sent(checkpoint)
        if answer.cancel and not job.cancel.is_set():
            log.info("cancel requested: job %s attempt %s; stopping its runner", job.claim.job_id, job.claim.attempt_id)
            job.cancel.set()

    def _discard(self, job: ActiveJob, why: str) -> None:
        log.warning("job %s attempt %s: stopping the runner and discarding its result: %s", job.claim.job_id, job.claim.attempt_id, why)
        job.discard = why
        job.cancel.set()
        if job.logs is not None:
            job.logs.stop()

    def _stop_for(self, verdict: Verdict, exc: QueueError) -> None:
        if verdict is Verdict.SUPERSEDED:
            self._fatal(f"another process registered worker id {self.spec.worker_id!r} ({exc}); exiting")
        else:
            what = "the worker token" if verdict is Verdict.UNAUTHORIZED and exc.code == "unauthorized" else "this worker"
            self._fatal(f"the control plane refused {what} ({exc.code}: {exc.message})")

    def _fatal(self, why: str) -> None:
        """Stop for good: every runner is stopped and its result discarded, since
        nothing will heartbeat or fence them once the loops end."""
        if self.fatal is None:
            self.fatal = why
        with self.lock:
            jobs = list(self.active.values())
        for job in jobs:
            self._discard(job, why)
        self.stopped.set()
        self.wake.set()
        self.freed.set()

    def _call(self, fn):
        """A control-plane call from the loops: transient failures are logged and
        answered None; a superseded session is fatal."""
        try:
            result = fn()
        except QueueError as exc:
            verdict = classify(exc)
            if verdict in FATAL:
                self._stop_for(verdict, exc)
            elif verdict is Verdict.RETRY:
                log.warning("control plane unavailable: %s", exc)
            else:
                raise
            return None
        self.last_contact = self.monotonic()
        return result

    # ------------------------------------------------------------------ jobs

    def flush_outbox(self) -> int:
        """Resend every unacknowledged finish; returns how many are still pending."""
        if self.outbox is None:
            return 0
        pending = self.outbox.pending()
        for entry in pending:
            try:
                state = self.transport.finish(
                    attempt_id=entry["attempt_id"], token=entry["token"], outcome=entry["outcome"],
                    summary=entry["summary"], error=entry["error"],
                )
            except QueueError as exc:
                verdict = classify(exc)
                if verdict is Verdict.RETRY:
                    log.warning("outbox: finish of attempt %s not delivered yet (%s)", entry["attempt_id"], exc)
                    return len(pending)
                if verdict is Verdict.UNAUTHORIZED:
                    raise
                if verdict is Verdict.REFUSED:
                    log.error("outbox: finish of attempt %s refused (%s); dropped", entry["attempt_id"], exc.message)
                    self.outbox.acknowledge(entry["id"], f"refused: {exc.code}")
                else:  # stale, or an attempt of a session that a newer one superseded
                    log.warning(
                        "outbox: finish of attempt %s refused as stale (%s); dropped", entry["attempt_id"], exc.message
                    )
                    self.outbox.acknowledge(entry["id"], "stale")
            else:
                log.info("outbox: finish of job %s attempt %s delivered → job %s", entry["job_id"], entry["attempt_id"], state)
                self.outbox.acknowledge(entry["id"], state)
        return 0

    def _run_job(self, job: ActiveJob) -> None:
        """A job thread: the job, then each job claimed with the finish of the one before."""
        try:
            while job is not None:
                job = self._run_one(job)
        finally:
            self.transport.close()
            self.freed.set()

    def _run_one(self, job: ActiveJob) -> ActiveJob | None:
        """Run the job and send its finish; the next job when the finish claimed one (active
        already, on this thread)."""
        claim = job.claim
        threading.current_thread().name = f"job-{claim.job_id}"  # a thread runs several, one after another
        try:
            try:
                outcome = self.executor.run(claim, job.cancel, grace=self.grace, journal=job.journal)
            except Exception as exc:  # a bug in a runner must not take the worker down
                log.exception("job %s attempt %s crashed in the executor", claim.job_id, claim.attempt_id)
                outcome = Outcome("failed", {}, f"executor error: {exc!r}")
            if job.logs is not None and not job.discard and not job.logs.close(LOG_FLUSH_WAIT):
                log.warning("job %s attempt %s: not all of its log reached the control plane", claim.job_id, claim.attempt_id)
            if job.discard:
                log.warning("job %s attempt %s result discarded: %s", claim.job_id, claim.attempt_id, job.discard)
                return None
            return self._finish(job, outcome)
        finally:
            if job.logs is not None:
                job.logs.stop()
            with self.lock:  # its slot is free now, not when the claim loop next looks at the thread
                self.active.pop(claim.attempt_id, None)

    def _finish(self, job: ActiveJob, outcome: Outcome) -> ActiveJob | None:
        """Send the job's finish until it is answered; the next job when the finish claimed one.
        Where the transport can (finish_and_claim), every try carries the job's last record and
        its quiet steps' log ends, and the first try claims the thread's next job in the finish's
        commit while the worker still claims; a resent finish claims nothing."""
        claim = job.claim
        chain = self.finish_and_claim
        claiming = chain is not None
        carried = self._carried(job) if chain is not None else {}
        if self.outbox is not None:
            job.outbox_id = self.outbox.record_finish(
                claim=claim, outcome=outcome.outcome, summary=outcome.summary, error=outcome.error
            )
        job.finishing = True
        backoff = Backoff(**FINISH_BACKOFF, rand=self.rand)
        finish = {"attempt_id": claim.attempt_id, "token": claim.token, "outcome": outcome.outcome,
                  "summary": outcome.summary, "error": outcome.error}  # fmt: skip
        while True:
            sent = self.monotonic()
            claims_wanted = 1 if claiming and not (self.draining.is_set() or self.stopped.is_set()) else 0
            try:
                if chain is not None:
                    state, claims, refused = chain(**finish, session=self.session, max_jobs=claims_wanted, **carried)
                    for why in refused:
                        log.warning("job %s attempt %s: %s; the finish went without it", claim.job_id, claim.attempt_id, why)
                else:
                    state, claims = self.transport.finish(**finish), []
            except QueueError as exc:
                claiming = False
                verdict = classify(exc)
                if verdict is Verdict.RETRY:
                    if job.discard:  # self-fenced while retrying: the outbox resends after a restart
                        return None
                    delay = backoff.failed(getattr(exc, "retry_after", None))
                    log.warning("finish of attempt %s failed (%s); retrying in %.2fs", claim.attempt_id, exc, delay)
                    self.sleep(delay)
                    if job.logs is not None:
                        job.logs.resend_deferred()
                    continue
                if verdict in FATAL:
                    self._stop_for(verdict, exc)
                elif verdict is Verdict.STALE:
                    log.warning(
                        "finish of job %s attempt %s refused as stale: %s; result discarded",
                        claim.job_id, claim.attempt_id, exc.message,
                    )
                    self._acknowledge(job, "stale")
                else:  # refused as malformed: resending cannot help; the lease will run out
                    log.error(
                        "finish of job %s attempt %s refused (%s): %s", claim.job_id, claim.attempt_id, exc.code, exc.message
                    )
                    self._acknowledge(job, f"refused: {exc.code}")
                return None
            except Exception:
                # A bug broke the call (in the claim, or in a write it carried): nothing of it was
                # written. Sent again claiming nothing, then also without the writes it carried.
                if claims_wanted:
                    log.exception("finish of attempt %s with a claim failed; sending it without one", claim.attempt_id)
                    claiming = False
                elif carried:
                    log.exception("finish of attempt %s failed; sending it without its last writes", claim.attempt_id)
                    carried = {}
                else:
                    raise
                continue
            self._acknowledge(job, state)
            self.finished_count += 1
            log.info(
                "finish: job %s attempt %s outcome %s → job %s%s",
                claim.job_id, claim.attempt_id, outcome.outcome, state, f" ({outcome.error})" if outcome.error else "",
            )
            return self._next(claims, sent, job) if claims else None

    @staticmethod
    def _carried(job: ActiveJob) -> dict:
        """What the finish carries of the job: its last record (Journal.record_before_finish) and
        the final chunks its log sender kept (LogSender.carried)."""
        carried = {}
        if job.journal is not None and job.journal.before_finish is not None:
            carried["record"] = job.journal.before_finish
        if job.logs is not None and job.logs.carried:
            carried["log_ends"] = list(job.logs.carried)
        return carried

    def _next(self, claims: list[Claim], sent: float, finished: ActiveJob) -> ActiveJob | None:
        """The jobs a finish claimed made active: the first to run next on the finished job's
        thread, in its slot, any other on a thread of its own; the first, or None."""
        with self.lock:  # _start assigns a job's thread under the lock, after the thread has started
            thread = finished.thread
        late = self.monotonic() - sent > self.margin / 2
        following = None
        for claim in claims:
            if following is None:
                following = self._start(claim, sent, late, thread=thread, replaces=finished.claim.attempt_id)
            else:
                self._start(claim, sent, late)
        return following

    def _acknowledge(self, job: ActiveJob, answer: str) -> None:
        if self.outbox is not None and job.outbox_id is not None:
            self.outbox.acknowledge(job.outbox_id, answer)
