"""The durable queue: jobs, their fenced attempts, affinity pins, history and
the registry of workers that claim them.

Rows here change only through jobqueue.services; the admin shows them read-only.
"""

import functools
import hashlib
import json

from django.db import models
from django.db.models import Q

from .conf import QueueConfig
from .types import Retry

# Column defaults from the one place each number lives (a job always gets them set at enqueue).
_QUEUE, _RETRY = QueueConfig(), Retry()


class JobState(models.TextChoices):
    QUEUED = "queued"
    """Committed and waiting for an eligible worker (maybe not before `available_at`)."""
    LEASED = "leased"
    """Held by its current attempt until the attempt finishes or its lease runs out."""
    SUCCEEDED = "succeeded"
    """Terminal: the worker finished it with outcome `succeeded`."""
    FAILED = "failed"
    """Terminal: finished `failed` with no retry left, or expired `max_attempts` times."""
    CANCELLED = "cancelled"
    """Terminal: cancelled while queued, or a cancel was recorded before its attempt ended."""


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# Every edge of the job state machine; services check each write through
# `check_transition` and tests walk this table. README "Job states" draws it.
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.QUEUED: frozenset({JobState.LEASED, JobState.CANCELLED}),
    JobState.LEASED: frozenset(
        {
            JobState.SUCCEEDED,  # finish succeeded
            JobState.FAILED,  # finish failed without retries left; or the last allowed expiry
            JobState.CANCELLED,  # finish after a cancel; expiry after a cancel
            JobState.QUEUED,  # lease expired, or failed with a retry left
        }
    ),
    JobState.SUCCEEDED: frozenset(),
    # An operator's retry (services.job_retry): the same job again, as a new attempt.
    JobState.FAILED: frozenset({JobState.QUEUED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
}


class AttemptState(models.TextChoices):
    ACTIVE = "active"
    """Holds the job's lease; heartbeats and a finish with its token are accepted."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    """Its lease ran out, or its worker registered again; its token is stale for good."""


ATTEMPT_TRANSITIONS: dict[str, frozenset[str]] = {
    AttemptState.ACTIVE: frozenset(
        {AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.CANCELLED, AttemptState.EXPIRED}
    ),
    AttemptState.SUCCEEDED: frozenset(),
    AttemptState.FAILED: frozenset(),
    AttemptState.CANCELLED: frozenset(),
    AttemptState.EXPIRED: frozenset(),
}


@functools.lru_cache(maxsize=4096)  # classes are few; every enqueue asks for its own
def _digest(pool: str | None, labels: tuple, capabilities: tuple, keys: tuple) -> str:
    canonical = json.dumps([pool, list(labels), list(capabilities), *keys], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class RequirementSet(models.Model):
    """A class of jobs: what they require of a worker (pool, labels,
    capabilities) and which limit keys they count against (project, source,
    agent, runner, pool). Jobs point to it; rows are immutable and few.

    A claim first decides in Python which classes this worker may take now —
    requirements satisfied, no limit key saturated — then walks the claim-order
    index of each such class only. So its cost does not grow with the number
    of queued jobs the worker cannot take, whether for want of a label or
    because their limit is reached."""

    pool = models.CharField(max_length=128, null=True, blank=True)
    labels = models.JSONField(default=list)
    capabilities = models.JSONField(default=list)
    project = models.CharField(max_length=128, default="")
    source = models.CharField(max_length=128, default="")
    agent = models.CharField(max_length=128, default="")
    runner = models.CharField(max_length=64, default="")
    digest = models.CharField(max_length=64, unique=True)

    @staticmethod
    def digest_of(
        pool: str | None, labels: list[str], capabilities: list[str], keys: tuple[str, str, str, str] = ("", "", "", "")
    ) -> str:
        """`keys` = (project, source, agent, runner)."""
        return _digest(pool, tuple(sorted(set(labels))), tuple(sorted(set(capabilities))), tuple(keys))

    @staticmethod
    def met(need_pool, need_labels, need_capabilities, *, pool: str | None, labels: set[str], capabilities: set[str]) -> bool:
        """DESIGN §3.3: the worker's pool equals the job's (when it has one), its
        labels and capabilities include the job's. The claim and status share it."""
        return (
            (need_pool is None or need_pool == pool)
            and labels.issuperset(need_labels)
            and capabilities.issuperset(need_capabilities)
        )

    def satisfied_by(self, *, pool: str | None, labels: set[str], capabilities: set[str]) -> bool:
        return self.met(self.pool, self.labels, self.capabilities, pool=pool, labels=labels, capabilities=capabilities)

    def __str__(self) -> str:
        return f"pool={self.pool or '*'} labels={self.labels} capabilities={self.capabilities}"


class Job(models.Model):
    """One unit of work in the queue: an opaque payload, where it may run
    (its requirement set and affinity key) and what it counts against (its
    limit keys). The queue never reads the payload; the enqueuer wrote it and
    every claim hands it to the worker unchanged."""

    key = models.CharField(max_length=512, unique=True, help_text="the enqueuer's dedup key")
    payload = models.JSONField(default=dict, blank=True)
    # Limit keys (and, for pool, also a requirement).
    project = models.CharField(max_length=128)
    source = models.CharField(max_length=128)
    agent = models.CharField(max_length=128)
    runner = models.CharField(max_length=64)
    pool = models.CharField(max_length=128, null=True, blank=True)
    # No index of its own: jobs are looked up by class only while queued (job_claim_order below
    # serves that), and a class is never deleted. Each index is one more page per enqueue.
    requirements = models.ForeignKey(RequirementSet, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    # Jobs with the same affinity key run on the worker that claimed the first of them.
    affinity_key = models.CharField(max_length=255, null=True, blank=True)
    priority = models.IntegerField(default=0)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    available_at = models.DateTimeField()
    attempt_count = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=_QUEUE.max_attempts)
    # Retry policy for attempts that finish `failed` (not for expiries).
    retry_max_attempts = models.PositiveIntegerField(default=_RETRY.max_attempts)
    retry_backoff = models.FloatField(default=_RETRY.backoff)
    retry_backoff_max = models.FloatField(default=_RETRY.backoff_max)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # Attempts numbered up to this one count against neither max_attempts nor the retry
    # policy: an operator's retry (services.job_retry) gives the job its whole budget again.
    retried_through = models.PositiveIntegerField(default=0)
    # Unique where set (Meta): a queued or finished job (NULL) writes no entry.
    current_attempt = models.ForeignKey(
        "Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    summary = models.JSONField(default=dict, blank=True)
    # Jobs to enqueue, per terminal state, in the transaction that settles this one (a
    # transactional outbox: the layer above's hooks). {"succeeded": [job spec, …], …}
    follow_ups = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # The claim's walk: queued jobs of one class in claim order. Partial,
            # so finished history never costs a claim anything.
            models.Index(
                fields=["requirements", "-priority", "available_at", "id"],
                name="job_claim_order",
                condition=Q(state="queued"),
            ),
            models.Index(fields=["state"], name="job_state"),
            models.Index(fields=["affinity_key"], name="job_affinity", condition=Q(affinity_key__isnull=False)),
        ]
        constraints = [
            # One job per attempt, as the one-to-one it was held (queue 0013); partial, so the
            # jobs that have none — every queued and most finished ones — hold no entry.
            models.UniqueConstraint(
                fields=["current_attempt"], name="job_current_attempt_unique", condition=Q(current_attempt__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.key} [{self.state}]"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES


class Attempt(models.Model):
    """A fenced claim of a job: an opaque token (only its hash is stored) and a lease."""

    # No index of their own: (job, number) and (worker, state) below lead with them, and
    # every index is one more write per claim.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()
    worker = models.ForeignKey("Worker", on_delete=models.PROTECT, related_name="attempts", db_index=False)
    session = models.CharField(max_length=64)
    token_hash = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=AttemptState.choices, default=AttemptState.ACTIVE)
    claimed_at = models.DateTimeField()
    lease_expires_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    # The job state its finish produced: a retried finish answers the same.
    job_state = models.CharField(max_length=16, blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_job_number_unique")]
        indexes = [
            # Live attempts: limit counts, capacity, the reaper.
            models.Index(fields=["lease_expires_at"], name="attempt_active_lease", condition=Q(state="active")),
            models.Index(fields=["worker", "state"], name="attempt_worker_state"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.pk} (job {self.job_id} #{self.number}) [{self.state}]"


class Affinity(models.Model):
    """An affinity key pinned to the worker that first claimed one of its jobs."""

    key = models.CharField(max_length=255, primary_key=True)
    worker_id = models.CharField(max_length=128)
    pinned_at = models.DateTimeField()

    class Meta:
        verbose_name_plural = "affinities"

    def __str__(self) -> str:
        return f"{self.key} → {self.worker_id}"


# The events that settle a job: the only ones looked up by time (the dashboard's outcomes per
# minute, selectors/dashboard.py), so the only ones jobevent_settled_at holds.
SETTLING_EVENT_KINDS = ("finished", "expired", "cancelled")


class JobEvent(models.Model):
    """A row per transition, written in the transition's own transaction."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events", db_index=False)  # jobevent_job leads with it
    kind = models.CharField(max_length=32)
    at = models.DateTimeField()
    worker_id = models.CharField(max_length=128, null=True, blank=True)
    # Its index is partial (below): an event of no attempt (enqueued, cancelled, retried) has no entry.
    attempt = models.ForeignKey(
        Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["job", "id"], name="jobevent_job"),
            # The dashboard's last hour. Partial: an enqueue's, a claim's or a retry's event has no entry.
            models.Index(fields=["at"], name="jobevent_settled_at", condition=Q(kind__in=SETTLING_EVENT_KINDS)),
            models.Index(fields=["attempt"], name="jobevent_attempt", condition=Q(attempt__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} job {self.job_id} {self.kind}"


class Worker(models.Model):
    """A process that claims jobs: the embedded worker or a remote one.

    `session` changes on every registration; calls carrying an older session
    are answered `session_superseded`. Health is computed from
    `last_heartbeat_at` and `worker_timeout` (jobqueue.selectors), not stored.
    """

    worker_id = models.CharField(primary_key=True, max_length=128)
    pool = models.CharField(max_length=128, null=True, blank=True)
    labels = models.JSONField(default=list)
    capabilities = models.JSONField(default=list)
    capacity = models.PositiveIntegerField(default=1)
    session = models.CharField(max_length=64)
    embedded = models.BooleanField(default=False)
    # What the worker says of itself in its heartbeats...
    draining = models.BooleanField(default=False)
    ready = models.BooleanField(default=True)
    # ...and what an operator asked of it (answered as `drain: true`).
    drain_requested = models.BooleanField(default=False)
    version = models.CharField(max_length=64, blank=True, default="")
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    registered_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    # An operator forgot it (services.worker_forget): out of every list and of the blocked-job
    # reasons until it registers or heartbeats again. A row, not a delete: its attempts are history.
    forgotten_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["worker_id"]

    def __str__(self) -> str:
        return self.worker_id


class WorkerEvent(models.Model):
    """What an operator did to a worker (drain, undrain, forget, credentials revoked, a pin
    released), with who did it in `detail["actor"]`. By id, not a foreign key: the worker
    may never have registered (a credential issued ahead) and a forgotten one keeps its events."""

    worker_id = models.CharField(max_length=128)
    kind = models.CharField(max_length=32)
    at = models.DateTimeField()
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["worker_id", "id"], name="workerevent_worker")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} worker {self.worker_id} {self.kind}"


class RecordState(models.TextChoices):
    STARTED = "started"
    """The attempt is about to do it (an external effect whose end is not known yet)."""
    DONE = "done"
    """Done, with its value: final; no attempt may change it."""


class JobRecord(models.Model):
    """A job's journal: what its attempts did, by key, each write fenced by the
    current attempt's token (services/records.py). The queue never reads the
    keys or values; the workflow layer keeps its effect ledger here (steps
    done and their outputs, publishes started and done, checkpoints), so a
    later attempt can skip what is done and a stale one can record nothing.
    A `done` record is final."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="records", db_index=False)  # (job, key) leads with it
    key = models.CharField(max_length=255)
    # The key up to its first ":" (all of it without one): how a layer above finds every done record
    # of one kind across jobs (the control plane's pending spawns) without reading every journal,
    # and without a LIKE or a key range, whose use of an index depends on the database's collation.
    kind = models.CharField(max_length=255, default="", editable=False)
    state = models.CharField(max_length=16, choices=RecordState.choices)
    value = models.JSONField(default=dict, blank=True)
    attempt_number = models.PositiveIntegerField(help_text="the attempt that wrote it last")
    started_by = models.PositiveIntegerField(null=True, blank=True, help_text="the attempt that recorded `started`")
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="jobrecord_job_key_unique")]
        indexes = [models.Index(fields=["kind", "id"], condition=Q(state="done"), name="jobrecord_done_kind")]

    def __str__(self) -> str:
        return f"job {self.job_id} {self.key} [{self.state}]"


class LogStream(models.Model):
    """A running step's output, as its attempt sends it (services/logs.py): opaque text per
    (attempt, name), the workflow layer's step history id. The queue keeps its last
    MAX_LOG_STREAM_BYTES; `dropped` counts what came before and is no longer kept."""

    # No index of their own: (attempt, name) and (job, id) below lead with them.
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="log_streams", db_index=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+", db_index=False)
    name = models.CharField(max_length=255)
    received = models.BigIntegerField(default=0, help_text="bytes of UTF-8 text received: the next chunk's offset")
    dropped = models.BigIntegerField(default=0, help_text="bytes at the start no longer kept")
    ended = models.BooleanField(default=False, help_text="its last chunk came")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["attempt", "name"], name="logstream_attempt_name_unique")]
        indexes = [models.Index(fields=["job", "id"], name="logstream_job")]

    def __str__(self) -> str:
        return f"attempt {self.attempt_id} {self.name} ({self.received} bytes)"


class LogChunk(models.Model):
    """Text of a stream from `offset` (bytes of UTF-8 from the stream's start). Chunks that
    arrive while the last one is small extend it, so a stream has a few dozen rows, not one per send."""

    stream = models.ForeignKey(LogStream, on_delete=models.CASCADE, related_name="chunks")
    offset = models.BigIntegerField()
    size = models.IntegerField(help_text="bytes of UTF-8")
    text = models.TextField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["stream", "offset"], name="logchunk_stream_offset_unique")]


class WorkerCredential(models.Model):
    """A worker's own bearer credential, bound to its worker id (README
    "Security"). Only the SHA-256 of the secret is kept; the secret is shown
    once, to whoever it was issued to. Several may be valid for one id at a
    time: that is the overlap of a rotation. Not a foreign key to Worker: an
    operator may issue one before the worker ever registers, and a revoked
    id keeps its rows (they are what refuses its re-enrolment)."""

    worker_id = models.CharField(max_length=128)
    digest = models.CharField(max_length=64, unique=True)
    hint = models.CharField(max_length=16, help_text="the secret's first characters, to tell credentials apart")
    issued_by = models.CharField(max_length=16, help_text="enrollment (the shared token) or operator")
    # SHA-256 of the key the worker sent with its enrolment: the same key again, before the
    # credential was ever used, is the same worker asking again after a lost answer.
    enrollment_digest = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="its worker's last registration with a credential")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["worker_id", "created_at"]
        indexes = [models.Index(fields=["worker_id"], name="credential_worker")]

    def __str__(self) -> str:
        return f"{self.worker_id} {self.hint}…"


class Wakeup(models.Model):
    """SQLite only: a wake-up for waiting claims, written in the transaction
    that made jobs claimable; every process's watcher reads the new rows
    (jobqueue.wakeup). PostgreSQL sends the same message as a NOTIFY instead.
    Old rows are pruned as new ones come."""

    message = models.TextField()
