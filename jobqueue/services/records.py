"""A job's journal (models.JobRecord): records written only through the
current attempt's token, for the layer above to keep what an attempt did.

The rules, one compare-and-set each:

* only the job's current, live attempt writes (StaleAttempt otherwise, as
  for a heartbeat): a paused or superseded worker records nothing;
* `started` may be written over `started` (a later attempt starting the
  same thing again: the answer says whether an earlier attempt started it,
  which is what an external effect whose end is unknown needs to know);
* `done` is final: writing over it changes nothing and answers the record
  as it is, so a later attempt reuses what an earlier one did.
"""

import json

from django.db import IntegrityError, connection, transaction

from ..clock import Clock
from ..exceptions import InvalidRequest
from ..models import JobRecord, RecordState
from ..types import Record
from . import attempts
from .common import now_of, service

MAX_KEY = 255
MAX_VALUE_BYTES = 64 * 1024  # a step's output, a checkpoint: the journal is not a log store


def _of(row: JobRecord, *, already_done: bool = False) -> Record:
    return Record(row.key, row.state, row.value, row.attempt_number, row.started_by, already_done)


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
    if state not in RecordState.values:
        raise InvalidRequest(f"state must be one of {', '.join(RecordState.values)}, got {state!r}", field="state")
    if not key or len(key) > MAX_KEY:
        raise InvalidRequest(f"key must be 1–{MAX_KEY} characters", field="key")
    value = value or {}
    if len(json.dumps(value)) > MAX_VALUE_BYTES:
        raise InvalidRequest(f"value is larger than {MAX_VALUE_BYTES} bytes", field="value")
    now = now_of(clock)
    with connection.cursor() as cursor:
        fenced = attempts.fenced_live(cursor, attempt_id, token, now, acting_as)
    number = fenced.number
    existing = JobRecord.objects.filter(job_id=fenced.job_id, key=key).first()
    if existing is None:
        try:
            with transaction.atomic():
                row = JobRecord.objects.create(
                    job_id=fenced.job_id, key=key, state=state, value=value, attempt_number=number,
                    started_by=number if state == RecordState.STARTED else None, updated_at=now,
                )  # fmt: skip
            return _of(row)
        except IntegrityError:  # another write of the same key came first: decide against it
            existing = JobRecord.objects.get(job_id=fenced.job_id, key=key)
    if existing.state == RecordState.DONE:
        return _of(existing, already_done=True)
    started_by = existing.started_by if state == RecordState.DONE else number
    updated = JobRecord.objects.filter(pk=existing.pk, state=RecordState.STARTED).update(
        state=state, value=value, attempt_number=number, started_by=started_by, updated_at=now
    )
    row = JobRecord.objects.get(pk=existing.pk)
    if not updated:  # it became done meanwhile
        return _of(row, already_done=True)
    if state == RecordState.STARTED:
        # The answer tells the writer whether an earlier attempt had started it.
        return Record(row.key, row.state, row.value, number, existing.started_by)
    return _of(row)


def job_records(*, attempt_id: int, token: str, acting_as: str | None = None, clock: Clock | None = None) -> list[Record]:
    """The journal of the attempt's job, for its current attempt (what it may skip)."""
    now = now_of(clock)
    with transaction.atomic(), connection.cursor() as cursor:
        fenced = attempts.fenced_live(cursor, attempt_id, token, now, acting_as)
        rows = JobRecord.objects.filter(job_id=fenced.job_id).order_by("id")
        return [_of(row) for row in rows]


def records_of_job(job_id: int) -> dict[str, Record]:
    """Every record of a job (for operators and the workflow layer on the control plane)."""
    return {row.key: _of(row) for row in JobRecord.objects.filter(job_id=job_id).order_by("id")}


__all__ = ["Record", "job_record", "job_records", "records_of_job"]


