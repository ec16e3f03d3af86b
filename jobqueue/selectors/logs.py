"""Reading the log streams attempts sent (services/logs.py says how they are kept): for
operators and the layer above, which knows what a stream is. Nothing here writes."""

import dataclasses
import datetime as dt

from django.db.models import Max

from ..exceptions import NotFound
from ..models import Attempt, LogChunk, LogStream
from ..types import MAX_LOG_CHUNK_BYTES

READ_LIMIT = 256 * 1024  # bytes of text one read answers at most (whole rows; at least one)



@dataclasses.dataclass(frozen=True)
class StreamInfo:
    attempt_number: int
    name: str
    received: int
    dropped: int
    ended: bool
    created_at: dt.datetime
    updated_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class LogText:
    """Text of a stream from `offset` (past what was asked when that was dropped) to `next_offset`."""

    name: str
    offset: int
    text: str
    next_offset: int
    received: int
    dropped: int
    ended: bool


def log_streams(*, job_id: int, attempt_number: int | None = None) -> list[StreamInfo]:
    """The job's streams (of one attempt, with `attempt_number`), in the order they began."""
    rows = LogStream.objects.filter(job_id=job_id).select_related("attempt").order_by("id")
    if attempt_number is not None:
        rows = rows.filter(attempt__number=attempt_number)
    return [
        StreamInfo(r.attempt.number, r.name, r.received, r.dropped, r.ended, r.created_at, r.updated_at) for r in rows
    ]


def latest_attempt_number(*, job_id: int) -> int | None:
    return Attempt.objects.filter(job_id=job_id).aggregate(n=Max("number"))["n"]


def log_read(*, job_id: int, attempt_number: int, stream: str, offset: int = 0, limit: int = READ_LIMIT) -> LogText:
    """The stream's text from `offset`: whole rows up to `limit` bytes (at least one row);
    NotFound for a stream the attempt never sent."""
    row = LogStream.objects.filter(job_id=job_id, attempt__number=attempt_number, name=stream).first()
    if row is None:
        raise NotFound(f"job {job_id} attempt {attempt_number} has no log stream {stream!r}")
    start = min(max(offset, row.dropped), row.received)
    parts, position = [], start
    for chunk in LogChunk.objects.filter(stream=row, offset__gte=start - MAX_LOG_CHUNK_BYTES).order_by("offset"):
        end = chunk.offset + chunk.size
        if end <= position:
            continue
        if parts and position - start + chunk.size > limit:
            break
        if chunk.offset < position:  # a row extended since the reader's last read: its new part
            # errors="ignore": an offset a reader chose (a tail) may fall inside a character
            parts.append(chunk.text.encode("utf-8")[position - chunk.offset :].decode("utf-8", errors="ignore"))
        else:
            parts.append(chunk.text)
        position = end
    return LogText(row.name, start, "".join(parts), max(position, start), row.received, row.dropped, row.ended)


__all__ = ["READ_LIMIT", "LogText", "StreamInfo", "latest_attempt_number", "log_read", "log_streams"]
