"""What crosses the queue's boundary: the values a worker gets back from a
claim or a heartbeat, the retry policy a job carries, and the few constants
both ends of the protocol must agree on.

Nothing here touches the database, so a remote worker (which has none)
imports these freely; jobqueue.services returns them and workers.http builds
them from the wire.
"""

import dataclasses
import datetime as dt
import hashlib
import re

WORKER_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
WORKER_ID_RE = re.compile(WORKER_ID_PATTERN)
WORKER_ID_HINT = "1–128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
# A worker's enrolment key: random, URL-safe; it makes a resent enrolment the same enrolment.
ENROLLMENT_KEY_PATTERN = r"[A-Za-z0-9_-]{32,128}"


def hash_token(token: str) -> str:
    """How every secret is kept: attempt tokens, credentials, enrolment keys (SHA-256, hex)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


# A per-worker credential starts so; it tells one from a shared token at a glance (and to a leak scanner).
CREDENTIAL_PREFIX = "apw_"
EMBEDDED_ID = "embedded"  # the control plane's own in-process worker: reserved, no remote caller may use it

# What a worker may say of itself at registration (PROTOCOL.md "POST workers/register"): enough for any
# real machine, small enough that a registration costs the claim and `apiary status` nothing to speak of.
MAX_CAPACITY = 256
MAX_LABELS = 32
MAX_CAPABILITIES = 64
MAX_NAME_LENGTH = 128  # of a label, a capability or a pool (as apiary.yaml allows them)

# The outcomes a worker may report for an attempt (AttemptState's terminal values but `expired`,
# which only the control plane decides).
OUTCOMES = ("succeeded", "failed", "cancelled")

@dataclasses.dataclass(frozen=True)
class Retry:
    """Retry policy for attempts that finish `failed` (expiries count against
    `max_attempts` instead): up to `max_attempts` failures in all, waiting an
    exponential, capped, jittered backoff between them."""

    max_attempts: int = 1
    backoff: float = 0.0
    backoff_max: float = 300.0


@dataclasses.dataclass(frozen=True)
class Claim:
    """A leased job, as a worker needs it. `token` is the only copy of the
    attempt's secret. `payload` is what the enqueuer stored, unchanged: the
    queue never reads it."""

    job_id: int
    attempt_id: int
    attempt_number: int
    token: str
    lease_expires_at: dt.datetime
    agent: str
    runner: str
    payload: dict


# The keys of a claimed job that are the queue's own; a job's payload may use any other
# key (the protocol sends payload keys beside these, see jobqueue.api.serializers.claimed_job).
CLAIM_FIELDS = frozenset(field.name for field in dataclasses.fields(Claim)) - {"payload"}


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    lease_expires_at: dt.datetime
    cancel: bool


# A job's journal (jobqueue/services/records.py says the rules): what both ends check of a record.
RECORD_STATES = ("started", "done")  # models.RecordState's values
MAX_RECORD_KEY = 255  # characters
MAX_RECORD_VALUE_BYTES = 64 * 1024  # of the value as compact UTF-8 JSON: the journal is not a log store
MAX_RECORDS_PER_JOB = 4096  # keys of one job's journal: what one attempt's token can make the control plane store
# A step's checkpoint, sent with an attempt heartbeat: record `checkpoint:<step>`, state `started`,
# value {"content": …}; the step is an id of the same shape as worker ids, the content at most this
# many bytes of UTF-8.
CHECKPOINT_PREFIX = "checkpoint:"
MAX_CHECKPOINT_BYTES = 64 * 1024
# A checkpoint record's value as JSON: each byte of content is at most 6 there (a control character
# becomes "\u001f"), so a full checkpoint may exceed MAX_RECORD_VALUE_BYTES; a reader allows this.
MAX_CHECKPOINT_VALUE_BYTES = 6 * MAX_CHECKPOINT_BYTES + len('{"content":""}')


# A record of a job's journal, as the services return it and the protocol carries it.
@dataclasses.dataclass(frozen=True)
class Record:
    key: str
    state: str
    value: dict
    attempt_number: int
    started_by: int | None
    already_done: bool = False  # this write found the record done and changed nothing

    @property
    def started_earlier(self) -> bool:
        """An attempt before the writer's started it (its end is unknown)."""
        return self.started_by is not None and self.started_by != self.attempt_number


# A running step's output, streamed by its attempt (jobqueue/services/logs.py says the rules): the
# queue keeps opaque text per (attempt, stream); the workflow layer names a stream after a step.
LOG_STREAM_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,254}"  # a step's history id: `plan`, `hook:failed:notify`
MAX_LOG_CHUNK_BYTES = 64 * 1024  # of one chunk's text as UTF-8
MAX_LOG_STREAM_BYTES = 1024 * 1024  # kept per stream: the last MiB (older text is dropped, and counted)
MAX_LOG_STREAMS_PER_ATTEMPT = 128  # what one attempt's token can make the control plane keep
MAX_LOG_BYTES_PER_ATTEMPT = 16 * 1024 * 1024  # kept over all of an attempt's streams
LOG_ATTEMPTS_KEPT = 2  # a job keeps the logs of its last two attempts (the one before shows why it was retried)
LOG_RETENTION = 7 * 24 * 3600.0  # seconds: a finished job's logs are pruned this long after it ended
MAX_LOG_OFFSET = 2**62  # a stream's position, in bytes of UTF-8 text


@dataclasses.dataclass(frozen=True)
class LogState:
    """A stream as the control plane keeps it, after a chunk was sent.
    `received`: bytes of text received (the next chunk's offset); `dropped`: bytes at its start no
    longer kept (the cap keeps the tail); `ended`: its last chunk came; `stored`: this chunk added text."""

    stream: str
    received: int
    dropped: int
    ended: bool
    stored: bool = True
