"""A job's journal (models.JobRecord): records written only through the
current attempt's token, for the layer above to keep what an attempt did.

The rules, one compare-and-set each:

* only the job's current, live attempt writes (StaleAttempt otherwise, as
  for a heartbeat): a paused or superseded worker records nothing;
* `started` may be written over `started` (a later attempt starting the
  same thing again: the answer says whether an earlier attempt started it,
  which is what an external effect whose end is unknown needs to know);
  `started_by` stays the first attempt that started it, so the same write
  resent after a lost answer says the same;
* `done` is final: writing over it changes nothing and answers the record
  as it is, so a later attempt reuses what an earlier one did;
* a checkpoint (attempt_heartbeat_with_checkpoint: a heartbeat and the latest
  content of a step's checkpoint file, in one transaction) is the record
  `checkpoint:<step>`, always `started` (never `done`: the next attempt of
  that step starts from it), its value `{"content": …}`.
"""

import datetime as dt
import functools
import re

from django.db import connection

from .. import jsonlimits, sql
from ..clock import Clock
from ..exceptions import InvalidRequest
from ..metrics import timed_heartbeat
from ..models import JobRecord, RecordState
from ..text import clean, has_unstorable
from ..types import (
    CHECKPOINT_PREFIX,
    MAX_CHECKPOINT_BYTES,
    MAX_RECORD_KEY,
    MAX_RECORD_VALUE_BYTES,
    MAX_RECORDS_PER_JOB,
    WORKER_ID_PATTERN,
    Heartbeat,
    Record,
)
from . import attempts
from .common import now_of, service

MAX_KEY = MAX_RECORD_KEY
MAX_VALUE_BYTES = MAX_RECORD_VALUE_BYTES
_STEP_RE = re.compile(WORKER_ID_PATTERN + r"\Z")
_STATES = frozenset(RecordState.values)  # Choices.values builds a new list at each look


def _of(row: JobRecord, *, already_done: bool = False) -> Record:
    return Record(row.key, row.state, row.value, row.attempt_number, row.started_by, already_done)


def _checked(key: str, state: str, value: dict | None) -> dict:
    """The value to store; InvalidRequest naming the field that is not a record's."""
    if state not in _STATES:
        raise InvalidRequest(f"state must be one of {', '.join(RecordState.values)}, got {state!r}", field="state")
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        raise InvalidRequest(f"key must be 1–{MAX_KEY} characters", field="key")
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise InvalidRequest(f"value must be a JSON object, got {type(value).__name__}", field="value")
    try:
        text = jsonlimits.check(value, max_bytes=MAX_VALUE_BYTES)
    except jsonlimits.JSONLimitError as exc:
        raise InvalidRequest(f"value must be JSON of at most {MAX_VALUE_BYTES} bytes: {exc}", field="value") from None
    # NUL and lone surrogates: PostgreSQL's jsonb refuses them. The text shows whether there are any.
    return clean(value) if "\\u0000" in text or has_unstorable(text) else value


def key_kind(key: str) -> str:
    """A record's kind: its key up to the first ":" (JobRecord.kind)."""
    return key.partition(":")[0]


@functools.cache
def _insert_new(postgres: bool) -> str:
    """A new key's record, inserted only while the job's journal has room (parameters: the row,
    then the job and the most keys) and the key is not in it (ON CONFLICT: nothing inserted).
    PostgreSQL types the text and NULL of a SELECT list as text, so those cells are cast."""
    value, started_by = ("CAST(%s AS jsonb)", "CAST(%s AS integer)") if postgres else ("%s", "%s")
    return (
        "INSERT INTO queue_jobrecord (job_id, key, kind, state, value, attempt_number, started_by, updated_at)"
        f" SELECT %s, %s, %s, %s, {value}, %s, {started_by}, %s"
        " WHERE (SELECT COUNT(*) FROM queue_jobrecord WHERE job_id = %s) < %s"  # a WHERE: SQLite's upsert after a SELECT needs one
        " ON CONFLICT (job_id, key) DO NOTHING"
    )


def _write(fenced, key: str, state: str, value: dict, now: dt.datetime, *, usually_there: bool = False) -> Record:
    """The write itself, for a fenced attempt, in the caller's transaction. A new key is one
    statement: the guarded insert. A key that is usually there already (a checkpoint, written
    again at every heartbeat) is read first, and inserted only when it is not."""
    number, job_id = fenced.number, fenced.job_id
    existing = JobRecord.objects.filter(job_id=job_id, key=key).first() if usually_there else None
    if existing is None:
        started_by = number if state == RecordState.STARTED else None
        params = [job_id, key, key_kind(key), state, sql.js(value), number, started_by, sql.ts(now)]
        with connection.cursor() as cursor:
            cursor.execute(_insert_new(sql.postgres()), [*params, job_id, MAX_RECORDS_PER_JOB])
            if cursor.rowcount == 1:
                return Record(key, state, value, number, started_by, False)
        existing = JobRecord.objects.filter(job_id=job_id, key=key).first()
        if existing is None:  # nothing inserted and no such key: the journal has no room
            raise InvalidRequest(f"a job's journal holds at most {MAX_RECORDS_PER_JOB} keys", field="key")
    if existing.state == RecordState.DONE:
        return _of(existing, already_done=True)
    # The first attempt that started it stays `started_by`: a resent write of a later attempt still
    # learns that an earlier one started it (its answer may have been lost, not the earlier start).
    started_by = existing.started_by or number
    updated = JobRecord.objects.filter(pk=existing.pk, state=RecordState.STARTED).update(
        state=state, value=value, attempt_number=number, started_by=started_by, updated_at=now
    )
    row = JobRecord.objects.get(pk=existing.pk)
    if not updated:  # it became done meanwhile
        return _of(row, already_done=True)
    return _of(row)


@service
def job_record(
    *,
    attempt_id: int,
    token: str,
    key: str,
    state: str,
    value: dict | None = None,
    acting_as: str | None = None,
    clock: Clock | None = None,
) -> Record:
    """Write `key` = `state` (`value`) in the attempt's job's journal; returns the record."""
    value = _checked(key, state, value)
    now = now_of(clock)
    with connection.cursor() as cursor:
        fenced = attempts.fenced_live(cursor, attempt_id, token, now, acting_as)
    return _write(fenced, key, state, value, now)


def write_fenced(fenced, *, key: str, state: str, value: dict | None, now: dt.datetime) -> Record:
    """job_record's work for an attempt that the caller fenced already in its transaction (a
    finish that carries its job's last record: services/chaining.py), by the same rules."""
    return _write(fenced, key, state, _checked(key, state, value), now)


def checkpoint_key(step: str) -> str:
    """The record a step's checkpoint is kept in; InvalidRequest for a step that is no step id."""
    if not isinstance(step, str) or not _STEP_RE.match(step):
        raise InvalidRequest(
            f"checkpoint step must be a step id (1–128 characters of A-Z a-z 0-9 . _ -), got {step!r:.80}",
            field="checkpoint",
        )
    return CHECKPOINT_PREFIX + step


@timed_heartbeat
@service
def attempt_heartbeat_with_checkpoint(
    *,
    attempt_id: int,
    token: str,
    step: str,
    content: str,
    acting_as: str | None = None,
    clock: Clock | None = None,
) -> Heartbeat:
    """An attempt heartbeat (attempts.attempt_heartbeat) that also keeps the
    latest content of `step`'s checkpoint, in the same transaction: a stale
    attempt extends nothing and keeps nothing."""
    key = checkpoint_key(step)
    if not isinstance(content, str) or len(content.encode("utf-8", "surrogatepass")) > MAX_CHECKPOINT_BYTES:
        raise InvalidRequest(f"checkpoint content must be text of at most {MAX_CHECKPOINT_BYTES} bytes", field="checkpoint")
    now = now_of(clock)
    with connection.cursor() as cursor:
        fenced, beat = attempts.extend_lease(cursor, attempt_id, token, now, acting_as)
    _write(fenced, key, RecordState.STARTED, {"content": clean(content)}, now, usually_there=True)
    return beat


@service
def job_records(*, attempt_id: int, token: str, acting_as: str | None = None, clock: Clock | None = None) -> list[Record]:
    """The journal of the attempt's job, for its current attempt (what it may skip)."""
    now = now_of(clock)
    with connection.cursor() as cursor:
        fenced = attempts.fenced_live(cursor, attempt_id, token, now, acting_as)
    return [_of(row) for row in JobRecord.objects.filter(job_id=fenced.job_id).order_by("id")]


def record_of_job(job_id: int, key: str) -> Record | None:
    """One record of a job, or None (for the workflow layer on the control plane)."""
    row = JobRecord.objects.filter(job_id=job_id, key=key).first()
    return _of(row) if row is not None else None


def records_of_job(job_id: int) -> dict[str, Record]:
    """Every record of a job (for operators and the workflow layer on the control plane)."""
    return {row.key: _of(row) for row in JobRecord.objects.filter(job_id=job_id).order_by("id")}


__all__ = ["Record", "attempt_heartbeat_with_checkpoint", "job_record", "job_records", "record_of_job", "records_of_job"]
