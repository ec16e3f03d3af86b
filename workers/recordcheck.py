"""What a remote worker accepts from a journal answer (`POST attempts/{id}/records`
and `…/records/list`, PROTOCOL.md), as workers/claimcheck.py does for claims:
the answer comes from the control plane or from whatever answers in its
place, and a record decides whether a publish runs again, so every field is
checked before a `Record` exists. Anything else is an InvalidRequest naming
the field, never a traceback.

| field | accepted |
|---|---|
| `key` | a string of 1–MAX_RECORD_KEY characters; the key written, for a write's answer |
| `state` | `started` or `done`; `done` when the write was `done` (a record never goes back) |
| `value` | a JSON object without NaN, nested at most MAX_DEPTH levels, at most MAX_RECORD_VALUE_BYTES as JSON (a checkpoint's: MAX_CHECKPOINT_VALUE_BYTES) |
| `attempt_number` | an integer from 1 to 2**31 - 1, not a boolean |
| `started_by` | null, or such an integer |
| `started_earlier`, `already_done` | booleans; `started_earlier` as `started_by` and `attempt_number` say |
"""

from jobqueue import jsonlimits
from jobqueue.exceptions import InvalidRequest
from jobqueue.types import (
    CHECKPOINT_PREFIX,
    MAX_CHECKPOINT_VALUE_BYTES,
    MAX_RECORD_KEY,
    MAX_RECORD_VALUE_BYTES,
    RECORD_STATES,
    Record,
)

MAX_ATTEMPT_NUMBER = 2**31 - 1


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _number(name: str, value, *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ATTEMPT_NUMBER:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_ATTEMPT_NUMBER}, got {_show(value)}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {_show(value)}")
    return value


def record_of(data, *, key: str | None = None, state: str | None = None) -> Record:
    """A Record from one record of an answer; ValueError naming the first field
    that fails. With `key`/`state` (a write's answer): it must be that key, and
    `done` when `done` was written."""
    if not isinstance(data, dict):
        raise ValueError(f"a record must be a JSON object, got {type(data).__name__}")
    got_key = data.get("key")
    if not isinstance(got_key, str) or not 1 <= len(got_key) <= MAX_RECORD_KEY:
        raise ValueError(f"key must be a string of 1–{MAX_RECORD_KEY} characters, got {_show(got_key)}")
    if key is not None and got_key != key:
        raise ValueError(f"key is {_show(got_key)}, not the key written ({_show(key)})")
    got_state = data.get("state")
    if got_state not in RECORD_STATES:
        raise ValueError(f"state must be one of {', '.join(RECORD_STATES)}, got {_show(got_state)}")
    if state == "done" and got_state != "done":
        raise ValueError(f"state is {got_state!r} after `done` was written (a done record is final)")
    value = data.get("value")
    if not isinstance(value, dict):
        raise ValueError(f"value must be a JSON object, got {type(value).__name__}")
    limit = MAX_CHECKPOINT_VALUE_BYTES if got_key.startswith(CHECKPOINT_PREFIX) else MAX_RECORD_VALUE_BYTES
    try:
        jsonlimits.check(value, max_bytes=limit)
    except jsonlimits.JSONLimitError as exc:
        raise ValueError(f"value: {exc}") from None
    record = Record(
        key=got_key,
        state=got_state,
        value=value,
        attempt_number=_number("attempt_number", data.get("attempt_number")),
        started_by=_number("started_by", data.get("started_by"), nullable=True),
        already_done=_flag("already_done", data.get("already_done")),
    )
    if _flag("started_earlier", data.get("started_earlier")) != record.started_earlier:
        raise ValueError("started_earlier does not agree with started_by and attempt_number")
    return record


def written(answer, *, key: str, state: str) -> Record:
    """The record of a `POST attempts/{id}/records` answer (`{"record": {…}}`)."""
    try:
        if not isinstance(answer, dict) or "record" not in answer:
            raise ValueError("the answer is not an object with a record")
        return record_of(answer["record"], key=key, state=state)
    except ValueError as exc:
        raise InvalidRequest(f"POST records: the control plane's answer is refused: {exc}") from None


def listed(answer) -> list[Record]:
    """The records of a `POST attempts/{id}/records/list` answer (`{"records": [{…}, …]}`), keys distinct."""
    try:
        if not isinstance(answer, dict) or not isinstance(answer.get("records"), list):
            raise ValueError("the answer is not an object with a list of records")
        records = [record_of(item) for item in answer["records"]]
        keys = [record.key for record in records]
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice")
        return records
    except ValueError as exc:
        raise InvalidRequest(f"POST records/list: the control plane's answer is refused: {exc}") from None
