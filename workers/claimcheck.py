"""What a remote worker accepts from a claim answer, and where claim data may
lead on its disk.

A claim answer comes from the control plane, or from whatever answers in its
place (a rogue server, a man in the middle where TLS is missing). Its fields
become path parts (workspace, logs, task file), environment values and
arguments on the worker, so `claim_of` checks every field before a `Claim`
exists, against what the control plane can produce:

| field | accepted |
|---|---|
| `job_id`, `attempt_id` | an integer from 1 to 2**63 - 1 (a 64-bit row id), not a boolean |
| `attempt_number` | an integer from 1 to 2**31 - 1 |
| `token` | 1–256 characters of A-Z a-z 0-9 _ - (`secrets.token_urlsafe`) |
| `lease_expires_at` | an ISO 8601 time with a zone, at most 64 characters |
| `agent`, `runner` | an id: 1–128 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit |
| every other key (the payload) | JSON without NaN, nested at most MAX_DEPTH levels, at most PAYLOAD_CAP bytes |

The payload stays opaque here (the queue's contract); the executor's reader
(workflows/payload.read) checks the workflow's own keys the same way.

A refused job is never run. When its `attempt_id` and `token` passed, the
worker finishes that attempt `failed`, with the reason, so the job's reason
tells the operator at once (and a retry or the next claim proceeds) instead
of the lease running out unexplained, max_attempts times over; otherwise its
lease runs out on the control plane. Either way it is logged.

`inside(root, *parts)` is the second line of defence: every path the worker
builds from claim data goes through it and is refused when a part is not one
plain name or the path resolves (through symlinks too) outside `root`.
"""

import datetime as dt
import os
import re
import stat
from pathlib import Path

from jobqueue import jsonlimits
from jobqueue.exceptions import InvalidRequest
from jobqueue.types import CLAIM_FIELDS, WORKER_ID_PATTERN, Claim

MAX_ID = 2**63 - 1
MAX_ATTEMPT_NUMBER = 2**31 - 1
PAYLOAD_CAP = 4 * 1024 * 1024  # bytes of one job's payload as JSON (the control plane caps a workflow job at 1 MiB)
_NAME_RE = re.compile(WORKER_ID_PATTERN + r"\Z")  # the same shape as config ids (workflows/config/schema.py)
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,256}\Z")
_TIME_MAX = 64


class ClaimRefused(ValueError):
    """A claimed job the worker will not run. `attempt_id` and `token` are set
    when both passed their checks, so the attempt can be finished `failed`."""

    def __init__(self, reason: str, *, job_id: str = "?", attempt_id: int | None = None, token: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.token = token


class PathOutside(ValueError):
    """A path built from claim data that would leave the worker's state directory."""


def _row_id(job: dict, name: str, maximum: int = MAX_ID) -> int:
    value = job.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be an integer from 1 to {maximum}, got {_show(value)}")
    return value


def _name(job: dict, name: str) -> str:
    value = job.get(name)
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"{name} must be an id (1–128 characters of A-Z a-z 0-9 . _ -), got {_show(value)}")
    return value


def _token(job: dict) -> str:
    value = job.get("token")
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        # Never quoted: it may be a real token.
        raise ValueError(f"token must be 1–256 characters of A-Z a-z 0-9 _ -, got {type(value).__name__}")
    return value


def _lease(job: dict) -> dt.datetime:
    value = job.get("lease_expires_at")
    if isinstance(value, str) and len(value) <= _TIME_MAX:
        try:
            moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            moment = None
        if moment is not None and moment.tzinfo is not None:
            return moment
    raise ValueError(f"lease_expires_at must be an ISO 8601 time with a zone, got {_show(value)}")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def claim_of(job) -> Claim:
    """A Claim from one job of a claim answer; ClaimRefused naming the first field that fails."""
    if not isinstance(job, dict):
        raise ClaimRefused(f"a job must be a JSON object, got {type(job).__name__}", job_id="?")
    job_id = _show(job.get("job_id"))  # for the log line: quoted and short, whatever it is
    attempt_id = token = None
    try:
        attempt_id = _row_id(job, "attempt_id")
        token = _token(job)
    except ValueError as exc:
        raise ClaimRefused(str(exc), job_id=job_id) from None
    try:
        payload = {key: value for key, value in job.items() if key not in CLAIM_FIELDS}
        try:
            jsonlimits.check(payload, max_bytes=PAYLOAD_CAP)
        except jsonlimits.JSONLimitError as exc:
            raise ValueError(f"payload: {exc}") from None
        return Claim(
            job_id=_row_id(job, "job_id"),
            attempt_id=attempt_id,
            attempt_number=_row_id(job, "attempt_number", MAX_ATTEMPT_NUMBER),
            token=token,
            lease_expires_at=_lease(job),
            agent=_name(job, "agent"),
            runner=_name(job, "runner"),
            payload=payload,
        )
    except ValueError as exc:
        raise ClaimRefused(str(exc), job_id=job_id, attempt_id=attempt_id, token=token) from None


def claims_of(answer) -> tuple[list[Claim], list[ClaimRefused]]:
    """The claims of a `POST claims` answer that pass, and the refusals of the
    others. An answer that is not `{"jobs": [...]}` raises InvalidRequest: the
    whole answer is refused as malformed (the runtime logs it in one line and
    claims again after its backoff), not one job."""
    if not isinstance(answer, dict):
        raise InvalidRequest(f"POST claims: the answer is not an object with a list of jobs (it is {type(answer).__name__})")
    jobs = answer.get("jobs")
    if not isinstance(jobs, list):
        got = f"its jobs is {type(jobs).__name__}" if "jobs" in answer else "it has no jobs"
        raise InvalidRequest(f"POST claims: the answer is not an object with a list of jobs ({got})")
    claims: list[Claim] = []
    refused: list[ClaimRefused] = []
    for job in jobs:
        try:
            claims.append(claim_of(job))
        except ClaimRefused as exc:
            refused.append(exc)
    # One attempt twice in an answer: run neither copy's twin blindly, and never finish an attempt we run.
    running = {claim.attempt_id for claim in claims}
    for exc in refused:
        if exc.attempt_id in running:
            exc.attempt_id = exc.token = None
    return claims, refused


def inside(root: Path, *parts: str) -> Path:
    """`root / part / …`, after checking each part is one plain name (no `/`,
    not `.` or `..`, no NUL) and that the path, with every symlink on it
    resolved, stays inside `root` (resolved too). PathOutside otherwise. The
    path returned is the unresolved one, as the caller would have built it."""
    for part in parts:
        _plain(part)
    return _inside(root, parts, _look(root, parts))


def inside_each(root: Path, parts: tuple[str, ...], names: list[str]) -> tuple[Path, list[Path]]:
    """`inside(root, *parts)`, and `inside(that, name)` for each of `names`, by the same checks;
    a folder that is not there is looked at once: nothing below it exists to be a symlink, so
    its names are only checked to be plain (a job's first steps, whose logs folder is new)."""
    for part in (*parts, *names):
        _plain(part)
    found = _look(root, parts)
    folder = _inside(root, parts, found)
    if found is _MISSING:
        return folder, [folder / name for name in names]
    return folder, [_inside(folder, (name,), _look(folder, (name,))) for name in names]


def _plain(part: str) -> None:
    if not isinstance(part, str) or part in ("", ".", "..") or "/" in part or "\0" in part:
        raise PathOutside(f"{_show(part)} is not a plain file or folder name")


def _inside(root: Path, parts: tuple[str, ...], found: object) -> Path:
    path = Path(root, *parts)
    if found is not _LINK:
        # Plain names, none a symlink: the path resolves to the resolved root with the parts
        # appended, inside it. (A stat per part, where resolving both walks every component.)
        return path
    base = Path(root).resolve()
    if not path.resolve().is_relative_to(base):
        raise PathOutside(f"{path} resolves outside {base}")
    return path


_LINK, _MISSING, _THERE = object(), object(), object()


def _look(root: Path, parts: tuple[str, ...]) -> object:
    """_LINK when `root / part…` is a symlink for any prefix of the parts; else _MISSING when
    one is not there (or not searchable: nothing below it exists to be a link); else _THERE."""
    current = os.fspath(root)
    for part in parts:
        current = os.path.join(current, part)
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return _LINK
        except OSError:
            return _MISSING
    return _THERE
