"""How a worker runtime talks to the queue: the seam between the one executor
core and its two job sources.

`InProcessTransport` calls jobqueue.services directly (the embedded worker);
`workers.http.HttpTransport` speaks the worker protocol over HTTP (remote
workers). Both raise the same domain errors — StaleAttempt,
SessionSuperseded, NotFound, Unavailable — so the runtime cannot tell them apart.
"""

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from django.db import close_old_connections, connections

from jobqueue import conf, services
from jobqueue.exceptions import QueueError
from jobqueue.groupcommit import GroupCommitter
from jobqueue.longpoll import claim_with_wait
from jobqueue.metrics import timed_heartbeat
from jobqueue.types import Claim, Heartbeat, LogState, Record


class TransportError(QueueError):
    """The control plane could not be reached (connection refused, timeout, 5xx); retryable."""

    code = "transport_error"
    retry_after: float | None = None  # seconds the control plane asked for (a 503's Retry-After)


class Unauthorized(QueueError):
    """The control plane refused the worker token; not retryable."""

    code = "unauthorized"


@dataclasses.dataclass(frozen=True)
class Registration:
    session: str
    lease_duration: float
    heartbeat_interval: float
    worker_timeout: float
    features: frozenset[str] = frozenset({"journal", "logs"})  # what the control plane serves beyond protocol 1's first version


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    pool: str | None
    labels: tuple[str, ...]
    capabilities: tuple[str, ...]
    capacity: int
    embedded: bool = False


class Transport(Protocol):
    def register(self, spec: WorkerSpec) -> Registration: ...

    def worker_heartbeat(self, *, session: str, draining: bool, ready: bool) -> bool:
        """Returns whether an operator asked this worker to drain."""

    def claim(self, *, session: str, max_jobs: int, wait: float) -> list[Claim]: ...

    def heartbeat(self, *, attempt_id: int, token: str, checkpoint: tuple[str, str] | None = None) -> Heartbeat:
        """Extends the lease; with `checkpoint` (step, content) also keeps that step's checkpoint."""

    def finish(self, *, attempt_id: int, token: str, outcome: str, summary: dict, error: str | None) -> str: ...

    # Optional, and only where a claim costs no round trip of its own (InProcessTransport):
    # finish_and_claim(attempt_id=, token=, outcome=, summary=, error=, session=, max_jobs=, record=, log_ends=)
    # -> (the job's state, [Claim, …], refusals), the finish, the job's last writes and a claim
    # of up to max_jobs in one commit.

    def record(self, *, attempt_id: int, token: str, key: str, state: str, value: dict) -> Record:
        """Writes `key` in the attempt's job's journal (jobqueue/services/records.py says the rules)."""

    def records(self, *, attempt_id: int, token: str) -> list[Record]:
        """The attempt's job's journal, oldest first."""

    def log_append(self, *, attempt_id: int, token: str, stream: str, offset: int, text: str, final: bool) -> LogState:
        """Appends `text` at `offset` to the attempt's log `stream` (jobqueue/services/logs.py says the rules)."""

    def close(self) -> None: ...


class InProcessTransport:
    """The embedded worker's transport: service calls in this process.

    Registration uses the calling thread's Django connection; `close()` drops
    it (job threads call it before they end). The calls
    of a job's attempt — claims, heartbeats, journal records, log appends,
    finishes — go through one group committer (jobqueue.groupcommit): calls
    that the worker's threads make at the same moment share one commit, and
    each still returns only after the commit that holds it."""

    def __init__(self, *, worker_id: str, committer: GroupCommitter | None = None):
        self.worker_id = worker_id
        # A thread of its own commits: job and log-sender threads come and go, and each would
        # otherwise open a database connection of its own (about 1.5 ms of CPU) to lead a commit.
        self.committer = committer or GroupCommitter()

    def register(self, spec: WorkerSpec) -> Registration:
        close_old_connections()
        worker = services.worker_register(
            worker_id=spec.worker_id,
            pool=spec.pool,
            labels=spec.labels,
            capabilities=spec.capabilities,
            capacity=spec.capacity,
            embedded=spec.embedded,
        )
        cfg = conf.current()
        return Registration(worker.session, cfg.lease_duration, cfg.heartbeat_interval, cfg.worker_timeout)

    def worker_heartbeat(self, *, session: str, draining: bool, ready: bool) -> bool:
        close_old_connections()
        worker = self.committer.call(
            services.worker_heartbeat, worker_id=self.worker_id, session=session, draining=draining, ready=ready
        )
        return worker.drain_requested

    def claim(self, *, session: str, max_jobs: int, wait: float) -> list[Claim]:
        close_old_connections()
        return claim_with_wait(
            worker_id=self.worker_id, session=session, max_jobs=max_jobs, wait=wait, committer=self.committer
        )

    @timed_heartbeat
    def heartbeat(self, *, attempt_id: int, token: str, checkpoint: tuple[str, str] | None = None) -> Heartbeat:
        if checkpoint is None:
            return self.committer.call(services.attempt_heartbeat, attempt_id=attempt_id, token=token)
        step, content = checkpoint
        return self.committer.call(
            services.attempt_heartbeat_with_checkpoint, attempt_id=attempt_id, token=token, step=step, content=content
        )

    def finish(self, *, attempt_id: int, token: str, outcome: str, summary: dict, error: str | None) -> str:
        return self.committer.call(
            services.attempt_finish, attempt_id=attempt_id, token=token, outcome=outcome, summary=summary, error=error
        )

    def finish_and_claim(
        self, *, attempt_id: int, token: str, outcome: str, summary: dict, error: str | None, session: str,
        max_jobs: int, record: dict | None = None, log_ends: Sequence[dict] = (),
    ) -> tuple[str, list[Claim], tuple[str, ...]]:
        """`finish`, and a claim of up to `max_jobs` for this worker in the finish's commit
        (services.attempt_finish_and_claim): a job thread goes on to its next job with no
        claim of its own and no hand-off to the claim loop. It carries the job's last record
        and its log ends, written under its fence; (the job's state, the claims, why any of
        those was refused)."""
        done = self.committer.call(
            services.attempt_finish_and_claim, attempt_id=attempt_id, token=token, outcome=outcome, summary=summary,
            error=error, worker_id=self.worker_id, session=session, max_jobs=max_jobs, record=record, log_ends=log_ends,
        )  # fmt: skip
        return done.job_state, done.claims, done.refused

    def record(self, *, attempt_id: int, token: str, key: str, state: str, value: dict) -> Record:
        return self.committer.call(services.job_record, attempt_id=attempt_id, token=token, key=key, state=state, value=value)

    def records(self, *, attempt_id: int, token: str) -> list[Record]:
        return self.committer.call(services.job_records, attempt_id=attempt_id, token=token)

    def log_append(self, *, attempt_id: int, token: str, stream: str, offset: int, text: str, final: bool) -> LogState:
        return self.committer.call(
            services.log_append, attempt_id=attempt_id, token=token, stream=stream, offset=offset, text=text, final=final
        )

    def log_append_later(self, *, attempt_id: int, token: str, stream: str, offset: int, text: str, final: bool) -> None:
        """`log_append` queued to commit with the next call someone waits for (LogSender's final
        chunks: the job's finish follows them), in the order it was queued; no answer."""
        self.committer.defer(
            services.log_append, attempt_id=attempt_id, token=token, stream=stream, offset=offset, text=text, final=final
        )

    def close(self) -> None:
        # Only a connection this thread opened: asking for `connection` on a thread that never
        # used the database would build a wrapper just to close it (job threads call the committer).
        for opened in connections.all(initialized_only=True):
            opened.close()
