"""A running step's output, streamed by its attempt (models.LogStream, LogChunk).

The queue keeps opaque text per (attempt, stream name); the layer above names
the streams (Apiary's workflows: a step's history id) and reads them back
(`log_streams`, `log_read`). The rules of `log_append`:

* only the job's current, live attempt appends, with its token, under the
  same identity and stale rules as its heartbeat and its journal
  (`attempts.fenced_live`): a paused, expired or finished attempt adds nothing;
* a chunk says where it starts (`offset`, in bytes of UTF-8 text from the
  stream's start). At the stream's end it is appended; a chunk that lies
  within what was received is a resend (at-least-once delivery) and adds
  nothing; one that overlaps the end adds only what lies beyond it; one
  that starts beyond the end means the sender skipped text it knew would not
  be kept: what was kept before is dropped and counted;
* a stream keeps its last MAX_LOG_STREAM_BYTES (the tail: a running step's
  newest output and a failed step's last words are what an operator reads;
  the whole log stays in the step's log file on its worker); `dropped`
  counts the bytes before what is kept, for the reader's truncation marker;
* `final` ends the stream: nothing more is appended (a resent last chunk
  still answers as before).

* an attempt keeps at most MAX_LOG_BYTES_PER_ATTEMPT over all its streams
  (a chunk past that is refused), a job the logs of its last
  LOG_ATTEMPTS_KEPT attempts, and `logs_prune` removes a finished job's logs
  LOG_RETENTION after it ended (the control plane's loop calls it).
Chunks that arrive while the stream's last row is small extend that row, so a
stream holds a bounded number of rows however often its sender sends.
"""

import dataclasses
import datetime as dt
import re

from django.db import IntegrityError, connection
from django.db.models import Min

from .. import sql
from ..clock import Clock
from ..exceptions import InvalidRequest, Unavailable
from ..models import LogChunk, LogStream
from ..types import (
    LOG_ATTEMPTS_KEPT,
    LOG_STREAM_PATTERN,
    MAX_LOG_BYTES_PER_ATTEMPT,
    MAX_LOG_CHUNK_BYTES,
    MAX_LOG_OFFSET,
    MAX_LOG_STREAM_BYTES,
    MAX_LOG_STREAMS_PER_ATTEMPT,
    LogState,
)
from . import attempts
from .common import now_of, savepoint_on_postgres, service

_STREAM_RE = re.compile(LOG_STREAM_PATTERN + r"\Z")
MERGE_BELOW = 8 * 1024  # bytes: a chunk row is extended by later sends until it holds this much
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _checked(stream: str, offset: int, text: str) -> bytes:
    """The chunk's text as UTF-8; InvalidRequest naming the field that is not a chunk's."""
    if not isinstance(stream, str) or not _STREAM_RE.match(stream):
        raise InvalidRequest(
            f"stream must be 1–255 characters of A-Z a-z 0-9 . _ : - starting with a letter or digit, got {stream!r:.80}",
            field="stream",
        )
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_LOG_OFFSET:
        raise InvalidRequest(f"offset must be an integer from 0 to {MAX_LOG_OFFSET}", field="offset")
    if not isinstance(text, str):
        raise InvalidRequest("text must be a string", field="text")
    if _UNSTORABLE.search(text):  # the offsets count the text as sent: it is never rewritten here
        raise InvalidRequest("text must hold no NUL and no lone surrogate", field="text")
    data = text.encode("utf-8")
    if len(data) > MAX_LOG_CHUNK_BYTES:
        raise InvalidRequest(f"text must be at most {MAX_LOG_CHUNK_BYTES} bytes of UTF-8", field="text")
    if offset + len(data) > MAX_LOG_OFFSET:
        raise InvalidRequest(f"the stream would pass {MAX_LOG_OFFSET} bytes", field="offset")
    return data


@dataclasses.dataclass(slots=True)
class _Stream:
    """A stream's row as this module reads and moves it (a model instance costs more to build than
    the rest of a small append)."""

    pk: int
    attempt_id: int
    name: str
    received: int
    dropped: int
    ended: bool


def _state(row: _Stream, *, stored: bool) -> LogState:
    return LogState(row.name, row.received, row.dropped, row.ended, stored)


# The hot path in plain SQL: a short step's whole log is usually one final append of one chunk.
_STREAMS_OF_ATTEMPT = "SELECT id, name, received, dropped, ended FROM queue_logstream WHERE attempt_id = %s"
_INSERT_STREAM = """
INSERT INTO queue_logstream (attempt_id, job_id, name, received, dropped, ended, created_at, updated_at)
VALUES (%s, %s, %s, 0, 0, %s, %s, %s) RETURNING id
"""
# A quiet step's whole stream (an empty final chunk at offset 0, the usual carried end) begun
# ended, while the attempt has room for one more stream (parameters: the row, then the attempt
# and the most streams) and has no such stream (ON CONFLICT: nothing inserted): one statement
# where a read of the attempt's streams before it made two.
_BEGIN_ENDED = """
INSERT INTO queue_logstream (attempt_id, job_id, name, received, dropped, ended, created_at, updated_at)
SELECT %s, %s, %s, 0, 0, TRUE, %s, %s
 WHERE (SELECT COUNT(*) FROM queue_logstream WHERE attempt_id = %s) < %s
    ON CONFLICT (attempt_id, name) DO NOTHING
"""
_LAST_CHUNK = "SELECT id, \"offset\", size FROM queue_logchunk WHERE stream_id = %s ORDER BY \"offset\" DESC LIMIT 1"
_INSERT_CHUNK = "INSERT INTO queue_logchunk (stream_id, \"offset\", size, text) VALUES (%s, %s, %s, %s)"
_EXTEND_CHUNK = "UPDATE queue_logchunk SET text = text || %s, size = size + %s WHERE id = %s"
_MOVE_STREAM = """
UPDATE queue_logstream SET received = %s, dropped = %s, ended = %s, updated_at = %s
 WHERE id = %s AND received = %s AND ended = %s
"""


def _stream_of(
    cursor, fenced, attempt_id: int, name: str, now: dt.datetime, *, size: int = 0, ended: bool = False
) -> tuple[_Stream, int]:
    """The attempt's stream `name` (begun now when new, and ended already with `ended`: an empty
    final chunk that begins it is the whole stream) and the bytes all its streams keep. A
    stream is begun only for a chunk (of `size` bytes) that the attempt's limits take: nothing
    is written before a refusal (a finish that carries the chunk commits without it)."""
    cursor.execute(_STREAMS_OF_ATTEMPT, [attempt_id])
    streams = [_Stream(pk, attempt_id, n, r, d, bool(e)) for pk, n, r, d, e in cursor.fetchall()]
    kept = sum(row.received - row.dropped for row in streams)
    for row in streams:
        if row.name == name:
            return row, kept
    if len(streams) >= MAX_LOG_STREAMS_PER_ATTEMPT:
        raise InvalidRequest(f"an attempt keeps at most {MAX_LOG_STREAMS_PER_ATTEMPT} log streams", field="stream")
    if kept + size > MAX_LOG_BYTES_PER_ATTEMPT:
        raise _over_limit(attempt_id)
    if not streams and fenced.number > LOG_ATTEMPTS_KEPT:
        # An attempt's first stream: the job keeps the logs of its last LOG_ATTEMPTS_KEPT attempts only.
        LogStream.objects.filter(
            job_id=fenced.job_id, attempt__number__lte=fenced.number - LOG_ATTEMPTS_KEPT
        ).delete()
    try:
        with savepoint_on_postgres():
            pk = sql.one(cursor, _INSERT_STREAM, [attempt_id, fenced.job_id, name, ended, sql.ts(now), sql.ts(now)])[0]
    except IntegrityError:  # the same stream begun by a concurrent call
        raise Unavailable(f"log stream {name!r} of attempt {attempt_id} was begun concurrently; send again") from None
    return _Stream(pk, attempt_id, name, 0, 0, ended), kept


def _append(cursor, row: _Stream, offset: int, data: bytes) -> tuple[int, int]:
    """Store `data` at `offset` (== row.received, or beyond it: a skip); (received, dropped) after."""
    dropped = row.dropped
    if offset > row.received:  # the sender skipped text: what came before is no tail of the stream now
        LogChunk.objects.filter(stream_id=row.pk).delete()
        dropped = offset
        last = None
    elif row.received == 0:  # a stream's first text: it has no chunk yet
        last = None
    else:
        last = sql.one(cursor, _LAST_CHUNK, [row.pk])
    text = data.decode("utf-8")
    # Extend the last row only while it is small: each extension rewrites it whole.
    if last is not None:
        last_id, last_offset, last_size = last
    if (
        last is not None and last_offset + last_size == offset and last_size < MERGE_BELOW
        and last_size + len(data) <= MAX_LOG_CHUNK_BYTES
    ):  # fmt: skip
        cursor.execute(_EXTEND_CHUNK, [text, len(data), last_id])
    else:
        cursor.execute(_INSERT_CHUNK, [row.pk, offset, len(data), text])
    received = offset + len(data)
    if received - dropped > MAX_LOG_STREAM_BYTES:  # keep the tail: whole rows, at most the cap
        LogChunk.objects.filter(stream_id=row.pk, offset__lt=received - MAX_LOG_STREAM_BYTES).delete()
        first = LogChunk.objects.filter(stream_id=row.pk).aggregate(first=Min("offset"))["first"]
        dropped = received if first is None else first
    return received, dropped


@service
def log_append(
    *,
    attempt_id: int,
    token: str,
    stream: str,
    offset: int,
    text: str,
    final: bool = False,
    acting_as: str | None = None,
    clock: Clock | None = None,
) -> LogState:
    """Append `text` at `offset` to the attempt's `stream` (the module's rules); the stream after it."""
    data = _checked(stream, offset, text)
    now = now_of(clock)
    with connection.cursor() as cursor:
        fenced = attempts.fenced_live(cursor, attempt_id, token, now, acting_as)
        return _append_checked(cursor, fenced, attempt_id, stream, offset, data, final, now)


def append_fenced(cursor, fenced, *, attempt_id: int, stream: str, offset: int, text: str, final: bool, now: dt.datetime) -> LogState:
    """log_append's work for an attempt that the caller fenced already in its transaction
    (attempts.fenced_live's answer, or a finish's: services/chaining.py), by the same rules."""
    return _append_checked(cursor, fenced, attempt_id, stream, offset, _checked(stream, offset, text), final, now)


def _append_checked(cursor, fenced, attempt_id: int, stream: str, offset: int, data: bytes, final: bool, now: dt.datetime) -> LogState:
    if final and offset == 0 and not data and fenced.number <= LOG_ATTEMPTS_KEPT and _begun_ended(
        cursor, fenced, attempt_id, stream, now
    ):
        return LogState(stream, 0, 0, True, False)
    # Otherwise too, a new stream whose first chunk is empty and final begins ended: no update follows.
    row, kept = _stream_of(cursor, fenced, attempt_id, stream, now, size=len(data), ended=final and offset == 0 and not data)
    end = offset + len(data)
    if end <= row.received:  # a resend of text already received (or an empty chunk within it)
        if final and end == row.received and not row.ended:
            _move(cursor, row, received=row.received, dropped=row.dropped, ended=True, now=now)
            row.ended = True
        return _state(row, stored=False)
    if row.ended:
        raise InvalidRequest(
            f"stream {stream!r} of attempt {attempt_id} ended at {row.received} bytes; nothing follows its last chunk",
            field="offset",
        )
    if offset < row.received:  # overlaps the end: only what lies beyond it is new
        try:
            data[row.received - offset :].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(
                f"offset {offset} overlaps the stream's end ({row.received}) inside a character", field="offset"
            ) from None
        data, offset = data[row.received - offset :], row.received
    if kept + len(data) > MAX_LOG_BYTES_PER_ATTEMPT:
        raise _over_limit(attempt_id)
    received, dropped = _append(cursor, row, offset, data)
    _move(cursor, row, received=received, dropped=dropped, ended=final, now=now)
    row.received, row.dropped, row.ended = received, dropped, final
    return _state(row, stored=True)


def _begun_ended(cursor, fenced, attempt_id: int, name: str, now: dt.datetime) -> bool:
    """Whether the stream was begun ended by _BEGIN_ENDED; when not (it exists, or the attempt
    has its most streams), _stream_of's read decides. An attempt past LOG_ATTEMPTS_KEPT takes
    that read: its first stream prunes the job's older logs."""
    at = sql.ts(now)
    cursor.execute(_BEGIN_ENDED, [attempt_id, fenced.job_id, name, at, at, attempt_id, MAX_LOG_STREAMS_PER_ATTEMPT])
    return cursor.rowcount == 1


def _over_limit(attempt_id: int) -> InvalidRequest:
    return InvalidRequest(
        f"attempt {attempt_id} keeps at most {MAX_LOG_BYTES_PER_ATTEMPT} bytes of logs over all its streams", field="text"
    )


def _move(cursor, row: _Stream, *, received: int, dropped: int, ended: bool, now: dt.datetime) -> None:
    """The stream's compare-and-set: from the end this call read, or nothing (a concurrent append)."""
    cursor.execute(_MOVE_STREAM, [received, dropped, ended, sql.ts(now), row.pk, row.received, row.ended])
    if cursor.rowcount != 1:
        raise Unavailable(f"log stream {row.name!r} of attempt {row.attempt_id} was appended to concurrently; send again")


__all__ = ["LogState", "append_fenced", "log_append"]


@service
def logs_prune(*, older_than: float, clock: Clock | None = None, batch: int = 500) -> int:
    """Delete the log streams of jobs that finished more than `older_than` seconds ago, at
    most `batch` streams a call (their chunks go with them); how many were deleted."""
    before = now_of(clock) - dt.timedelta(seconds=older_than)
    ids = list(
        LogStream.objects.filter(job__finished_at__lt=before).order_by("id").values_list("id", flat=True)[:batch]
    )
    if ids:
        LogStream.objects.filter(id__in=ids).delete()
    return len(ids)
