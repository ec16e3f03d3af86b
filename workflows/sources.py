"""Sources: turn a folder of files or a command's JSON output into items.

`poll(source)` only reads; deciding what is new (the enqueue key makes a
re-poll of an unchanged item a no-op) and what changed (`content_hash`) is the
dispatcher's job. A source that cannot be read raises `SourceError`; the
caller logs it and tries again next interval, keeping the tasks it knows.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import logging
import os
import re
import selectors
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import TYPE_CHECKING, Any

import yaml

from jobqueue import jsonlimits
from workers.pgroups import KILL_WAIT, kill_process_group

from . import payload, yamlload

if TYPE_CHECKING:
    from workflows.config import SourceConfig

logger = logging.getLogger("apiary.sources")

COMMAND_MIN_TIMEOUT = 60.0  # seconds; a command gets max(poll_interval, this)
STDERR_TAIL = 2048  # bytes of stderr quoted in a SourceError
STDOUT_CAP = 64 * 1024 * 1024  # bytes of output read from a command; more is an error, never buffered
# Seconds to keep reading after the command exited or was killed: a process that left its group
# (setsid, a daemonising helper) may hold the pipes open for as long as it likes.
DRAIN_GRACE = 1.0
_CHUNK = 65536
TASK_FILE_CAP = 256 * 1024  # bytes of one directory item's file; a larger file is skipped unread
FRONT_MATTER_CAP = 64 * 1024  # bytes of its YAML front matter, checked before it is parsed
_RESERVED = ("id", "title", "body", "updated_at")  # command fields that are not payload
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)^---[ \t]*(?:\r?\n|\Z)", re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


@dataclass(frozen=True)
class Item:
    key: str
    title: str
    body: str
    payload: dict
    content_hash: str
    updated_at: str | None


class SourceError(Exception):
    """A source could not be polled this time (missing folder, failing command, bad output)."""


def poll(source: SourceConfig, *, cwd: Path | None = None) -> list[Item]:
    """Every item the source offers now, sorted by key. `cwd` is where a
    command runs and what a relative `path` is relative to (the config's folder)."""
    if source.type == "directory":
        return _poll_directory(source, cwd=cwd)
    if source.type == "command":
        return _poll_command(source, cwd=cwd)
    raise SourceError(f"source {source.id!r}: unknown type {source.type!r} (expected 'directory' or 'command')")


# --- directory -----------------------------------------------------------------------------------


def _poll_directory(source: SourceConfig, *, cwd: Path | None) -> list[Item]:
    root = Path(source.path)
    if not root.is_absolute() and cwd is not None:
        root = Path(cwd) / root
    root = root.resolve()
    if not root.is_dir():
        raise SourceError(f"source {source.id!r}: directory {root} does not exist or is not a directory")
    pattern = source.pattern or "*"
    try:
        paths = list(root.glob(pattern))
    except (ValueError, NotImplementedError) as exc:
        raise SourceError(f"source {source.id!r}: invalid pattern {pattern!r}: {exc}") from None
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise SourceError(f"source {source.id!r}: cannot open directory {root}: {exc.strerror}") from None
    items = []
    try:
        for path in paths:
            relative = path.relative_to(root)
            # Like a shell glob, skip hidden files and folders (.git, editor swap files, .DS_Store).
            # `..` starts with a dot too: nothing above the root is read.
            if any(part.startswith(".") for part in relative.parts):
                continue
            raw, stat = _read_inside(source, root_fd, relative)
            if raw is None:
                continue
            item = _file_item(source, path, relative.as_posix(), raw, stat)
            if item is not None:
                items.append(item)
    finally:
        os.close(root_fd)
    items.sort(key=lambda item: item.key)
    return items


def _read_inside(source: SourceConfig, root_fd: int, relative: Path) -> tuple[bytes | None, os.stat_result | None]:
    """The bytes of the regular file `relative` below the root, walking down
    from the root's descriptor one component at a time with O_NOFOLLOW: a
    symlink anywhere on the way (a file or a folder, swapped in after the glob
    or there all along) is refused by the kernel, so nothing outside the root
    is ever read. (None, None) for an entry that is skipped: a symlink, not a
    regular file (a folder the pattern matched, a FIFO, a device), unreadable,
    or over TASK_FILE_CAP."""
    fds: list[int] = []
    try:
        try:
            parent = root_fd
            for part in relative.parts[:-1]:
                parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
                fds.append(parent)
            # O_NONBLOCK: opening a FIFO swapped in for a file must not wait for a writer.
            fd = os.open(relative.parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
            fds.append(fd)
            stat = os.fstat(fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink (ELOOP), or one on the way
                _skip_once(source, relative, "a symbolic link (or below one); only regular files inside the folder are read")
            elif exc.errno == errno.EISDIR:
                pass
            else:
                logger.warning("source %s: skipping %r: cannot read it (%s)", source.id, str(relative), exc.strerror)
            return None, None
        if S_ISDIR(stat.st_mode):
            return None, None  # a folder the pattern matched, as before
        if not S_ISREG(stat.st_mode):
            _skip_once(source, relative, "not a regular file")
            return None, None
        if stat.st_size > TASK_FILE_CAP:
            logger.warning(
                "source %s: skipping %r: %d bytes, more than TASK_FILE_CAP (%d)",
                source.id, str(relative), stat.st_size, TASK_FILE_CAP,
            )
            return None, None
        chunks, total = [], 0
        try:
            while chunk := os.read(fd, min(_CHUNK, TASK_FILE_CAP + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > TASK_FILE_CAP:
                    logger.warning(
                        "source %s: skipping %r: more than TASK_FILE_CAP (%d) bytes", source.id, str(relative), TASK_FILE_CAP
                    )
                    return None, None
        except OSError as exc:
            logger.warning("source %s: skipping %r: cannot read it (%s)", source.id, str(relative), exc.strerror)
            return None, None
        return b"".join(chunks), stat
    finally:
        for fd in reversed(fds):
            os.close(fd)


SKIPPED_CAP = 10_000  # skipped entries remembered (not logged again); the least recently seen is forgotten first
# (source, relative path, why) already logged by this process, least recently seen first.
_skipped: OrderedDict[tuple[str, str, str], None] = OrderedDict()
_skipped_lock = threading.Lock()


def _skip_once(source: SourceConfig, relative: Path, why: str) -> None:
    """Log a skipped entry the first time only: a symlink stays a symlink, and
    one warning per poll would bury everything else. The path is quoted with
    repr, so a newline or an escape in a file name cannot forge a log line.

    At most SKIPPED_CAP entries are remembered, as an LRU: a folder where
    symlink names keep changing cannot grow the memory without bound, and an
    entry still there is seen every poll, so only one gone for long (or one of
    more than SKIPPED_CAP at once) is forgotten and logged again."""
    entry = (source.id, str(relative), why)
    with _skipped_lock:
        if entry in _skipped:
            _skipped.move_to_end(entry)
            return
        _skipped[entry] = None
        while len(_skipped) > SKIPPED_CAP:
            _skipped.popitem(last=False)
    logger.warning("source %s: skipping %r: %s", source.id, str(relative), why)


def _file_item(source: SourceConfig, path: Path, key: str, raw: bytes, stat: os.stat_result) -> Item | None:
    if b"\0" in raw:
        logger.warning("source %s: skipping %s: binary file", source.id, path)
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        logger.warning("source %s: skipping %s: not UTF-8 text", source.id, path)
        return None
    text = text.removeprefix("\ufeff")
    fields: dict[str, Any] = {}
    body = text
    match = _FRONT_MATTER.match(text)
    if match:
        front = match.group(1)
        if len(front.encode("utf-8")) > FRONT_MATTER_CAP:
            logger.warning(
                "source %s: skipping %s: front matter over FRONT_MATTER_CAP (%d bytes)", source.id, path, FRONT_MATTER_CAP
            )
            return None
        try:
            loaded = yamlload.load(front)
        except yaml.YAMLError as exc:
            # The front matter starts on the file's line 2 (after the opening ---).
            problem = yamlload.problem(exc, line_offset=1)
            logger.warning("source %s: skipping %s: invalid YAML front matter (%s)", source.id, path, problem)
            return None
        if loaded is not None and not isinstance(loaded, dict):
            logger.warning("source %s: skipping %s: front matter is not a mapping of fields", source.id, path)
            return None
        fields = _jsonable(loaded or {})
        body = text[match.end() :]
    title = fields.get("title")
    title = str(title).strip() if title not in (None, "") else _title_from(body) or key
    item_payload = {**fields, "path": str(path), "body": body}
    try:
        payload.task_payload_check(item_payload)
    except payload.PayloadError as exc:
        logger.warning("source %s: skipping %s: %s", source.id, path, exc)
        return None
    updated = dt.datetime.fromtimestamp(stat.st_mtime, tz=dt.UTC).isoformat()
    return Item(
        key=key,
        title=title,
        body=body,
        payload=item_payload,
        content_hash=hashlib.sha256(raw).hexdigest(),
        updated_at=updated,
    )


def _title_from(body: str) -> str:
    """The first Markdown heading, else the first non-empty line."""
    heading = _HEADING.search(body)
    if heading:
        return heading.group(1).strip()
    for line in body.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _jsonable(value: Any) -> Any:
    """YAML gives dates, sets and non-string keys; the payload is stored as JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


# --- command -------------------------------------------------------------------------------------


def _poll_command(source: SourceConfig, *, cwd: Path | None) -> list[Item]:
    command = source.command
    if not command:
        raise SourceError(f"source {source.id!r}: type 'command' needs a command")
    argv = ["sh", "-c", command] if isinstance(command, str) else [str(part) for part in command]
    timeout = max(float(source.poll_interval or 0), COMMAND_MIN_TIMEOUT)
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own group, so a timeout ends the command's children too (and frees the pipes).
            start_new_session=True,
        )
    except OSError as exc:
        raise SourceError(f"source {source.id!r}: cannot start {argv[0]!r}: {exc}") from exc
    try:
        stdout, stderr, timed_out = _read_output(proc, source=source, timeout=timeout)
    finally:
        _end(proc)
    if timed_out:
        raise SourceError(
            f"source {source.id!r}: command timed out after {timeout:g}s (exit {proc.returncode}); "
            f"stderr tail: {_tail(stderr)}"
        )
    if proc.returncode != 0:
        raise SourceError(f"source {source.id!r}: command exited with {proc.returncode}; stderr tail: {_tail(stderr)}")
    try:
        objects = _parse_objects(stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SourceError(
            f"source {source.id!r}: malformed output (exit {proc.returncode}): {exc}; stderr tail: {_tail(stderr)}"
        ) from None
    items: dict[str, Item] = {}
    for number, obj in enumerate(objects, start=1):
        try:
            item = _object_item(obj)
        except ValueError as exc:
            raise SourceError(
                f"source {source.id!r}: object {number} of the output: {exc} (exit {proc.returncode}); "
                f"stderr tail: {_tail(stderr)}"
            ) from None
        if item.key in items:
            raise SourceError(f"source {source.id!r}: id {item.key!r} appears twice in the output")
        items[item.key] = item
    return sorted(items.values(), key=lambda item: item.key)


def _read_output(proc: subprocess.Popen, *, source: SourceConfig, timeout: float) -> tuple[bytes, bytes, bool]:
    """(stdout, stderr tail, timed out) of a running command, read as it comes.

    Stops reading DRAIN_GRACE seconds after the command exits or is killed
    even when the pipes are still open, and raises once stdout passes
    STDOUT_CAP: neither a stray process nor a flood of output can hold the
    poll or its memory."""
    stdout, stderr = bytearray(), b""
    deadline = time.monotonic() + timeout
    stop_at = None  # set once the command is gone: read what is left until then
    timed_out = False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if stop_at is None and now >= deadline:
                timed_out = True
                kill_process_group(proc.pid, 1.0)
                stop_at = time.monotonic() + DRAIN_GRACE
            elif stop_at is None and proc.poll() is not None:
                stop_at = now + DRAIN_GRACE
            if stop_at is not None and now >= stop_at:
                break  # what is left holds the pipes from outside the command: give up on it
            limit = stop_at if stop_at is not None else deadline
            # Wake at least every 0.1 s to notice the command's exit while a stray child keeps the pipes.
            for key, _ in selector.select(max(0.0, min(limit - now, 0.1))):
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.fileobj is proc.stderr:
                    stderr = (stderr + chunk)[-STDERR_TAIL:]
                else:
                    stdout += chunk
                    if len(stdout) > STDOUT_CAP:
                        raise SourceError(
                            f"source {source.id!r}: command printed more than {STDOUT_CAP} bytes "
                            f"(STDOUT_CAP); stopped reading it; stderr tail: {_tail(stderr)}"
                        )
    if not timed_out:
        try:  # the output is closed; the command may still be running
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return bytes(stdout), stderr, timed_out


def _end(proc: subprocess.Popen) -> None:
    """End whatever is left of the command's group, close our ends of its pipes
    and reap it. A background child of the command goes too, as after a step."""
    kill_process_group(proc.pid, 1.0)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    try:
        proc.wait(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
        logger.warning("command pid %s did not exit after SIGKILL; leaving it", proc.pid)


def _parse_objects(text: str) -> list[dict]:
    """A JSON array of objects, or JSON lines of objects."""
    stripped = text.strip()
    if not stripped:
        return []
    if stripped.startswith("["):
        try:
            loaded = jsonlimits.loads(stripped)
        except jsonlimits.JSONLimitError as exc:
            raise ValueError(f"not a JSON array: {exc}") from None
        objects = loaded
    else:
        objects = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    objects.append(jsonlimits.loads(line))
                except jsonlimits.JSONLimitError as exc:
                    raise ValueError(f"line {number} is not JSON: {exc}") from None
    for number, obj in enumerate(objects, start=1):
        if not isinstance(obj, dict):
            raise ValueError(f"item {number} is {type(obj).__name__}, expected an object")
    return objects


def _object_item(obj: dict) -> Item:
    if "id" not in obj:
        raise ValueError(f"missing 'id' in {_preview(obj)}")
    raw_id = obj["id"]
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or str(raw_id) == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {raw_id!r}")
    key = str(raw_id)
    body = _text(obj.get("body"))
    title = _text(obj.get("title")) or _title_from(body) or key
    updated = obj.get("updated_at")
    item_payload = {k: v for k, v in obj.items() if k not in _RESERVED}
    payload.task_payload_check(item_payload, what=f"the payload of id {key!r}")  # a PayloadError is a ValueError
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Item(
        key=key,
        title=title,
        body=body,
        payload=item_payload,
        # surrogatepass: a lone surrogate from JSON ("\ud800") must not fail the whole poll.
        content_hash=hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest(),
        updated_at=None if updated is None else str(updated),
    )


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tail(stderr: bytes) -> str:
    text = stderr[-STDERR_TAIL:].decode("utf-8", errors="replace").strip()
    return text or "(empty)"


def _preview(obj: dict) -> str:
    text = json.dumps(obj, ensure_ascii=False)
    return text if len(text) <= 200 else text[:200] + "…"
