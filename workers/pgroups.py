"""A worker's record of the process groups its steps run in.

Every step runs in its own process group. The worker appends the group id
(with its leader's start time) to `.apiary/run/<worker-id>/groups` before the
step can do anything, and a line that it ended when the step ends, so when a
worker (or the daemon embedding it) is SIGKILLed, its successor finds the
groups left behind and ends them before the job runs again: two copies of one
step never run side by side.

One appended line per start and per end, on a descriptor kept open: a write
survives the writer's SIGKILL (the page cache has it), and it costs one call
where a file per group cost a create and an unlink (ext4 spends a
millisecond on unlinking a file with data). Once the record outgrows
COMPACT_BYTES it is rewritten with the live groups only. A group file
`<pgid>` holding the start time is how the record was kept before
(`recorded` still reads it, so a successor of an older worker ends its groups).
One process records in a directory at a time (the worker id's).
"""

import contextlib
import logging
import os
import re
import signal
import threading
import time
import weakref
from pathlib import Path

log = logging.getLogger("apiary.worker")

POLL = 0.05  # how often a group's end is checked while waiting for it
KILL_WAIT = 5.0  # how long to wait for a SIGKILLed group to disappear before giving up
RECORD = "groups"  # the record's file name in the worker's directory
COMPACT_BYTES = 64 * 1024  # a record larger than this is rewritten with the live groups only


class ProcessGroups:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the job threads of one worker share the record
        self._live: dict[int, str] = {}  # pgid → its leader's start time as recorded ("" when unknown)
        self._fd: int | None = None  # opened by the first add
        self._size = 0
        self._torn = False  # a write failed part-way: the next one first ends that line as malformed

    def add(self, pgid: int) -> None:
        """Record the group; OSError when it cannot be (the step must then not run)."""
        started = process_start_time(pgid)
        with self._lock:
            self._append(f"+{pgid} {'' if started is None else started}\n")
            self._live[pgid] = "" if started is None else str(started)

    def remove(self, pgid: int) -> None:
        """The group ended. Not recording that only makes a successor look at a group that is gone."""
        with self._lock:
            if self._live.pop(pgid, None) is None:
                return
            try:
                self._append(f"-{pgid}\n")
                if self._size > COMPACT_BYTES:
                    self._compact()
            except OSError as exc:
                log.warning("process group %s ended but could not be recorded as ended: %s", pgid, exc)

    def _append(self, line: str) -> None:
        if self._fd is None:
            self._keep(_open_record(self.directory / RECORD))
            self._size = os.fstat(self._fd).st_size
        data = (b"x\n" if self._torn else b"") + line.encode()
        self._torn = True
        written = 0
        while written < len(data):  # O_APPEND, and only this process writes here
            written += os.write(self._fd, data[written:])
        self._torn = False
        self._size += len(data)

    def _compact(self) -> None:
        """The live groups alone, in a new record that replaces the old one whole (a rename)."""
        draft = self.directory / (RECORD + ".new")
        fd = _open_record(draft, truncate=True)
        try:
            data = "".join(f"+{pgid} {started}\n" for pgid, started in self._live.items()).encode()
            if os.write(fd, data) != len(data):
                raise OSError(f"{draft}: short write")
            os.replace(draft, self.directory / RECORD)
        except OSError:
            os.close(fd)
            raise
        self._keep(fd)
        self._size = len(data)

    def _keep(self, fd: int) -> None:
        """`fd` is the record's descriptor from now on (the previous one closed), until this object goes."""
        if self._fd is not None:
            self._closer()
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def reap_orphans(self, *, grace: float = 5.0) -> list[int]:
        """At the worker's start, before any step of its own runs: end every recorded
        group still alive, then forget the record; returns the groups ended. A group
        whose leader is alive but started at another time is someone else's (a
        reused pid) and is left alone."""
        ended = []
        for pgid, started in sorted(recorded(self.directory).items()):
            if process_group_alive(pgid):
                log.warning("ending process group %s left behind by a previous worker process", pgid)
                if kill_process_group(pgid, grace, leader_started=started):
                    ended.append(pgid)
        for entry in self.directory.iterdir():
            if entry.name.isdigit() or entry.name in (RECORD, RECORD + ".new"):
                entry.unlink(missing_ok=True)
        return ended


# A whole line of the record: `+<pgid> <start time or nothing>` or `-<pgid>`.
_LINE = re.compile(r"\+([0-9]+) ([0-9]*)|-([0-9]+)")


def recorded(directory: Path) -> dict[int, int | None]:
    """The groups a worker recorded in `directory` and did not record as ended:
    pgid → its leader's start time (None when unknown)."""
    groups: dict[int, int | None] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return groups
    for entry in entries:
        if entry.name.isdigit():  # an older worker's file per group
            with contextlib.suppress(OSError):
                text = entry.read_text().strip()
                groups[int(entry.name)] = int(text) if text.isdigit() else None
    try:
        text = (directory / RECORD).read_text(encoding="ascii", errors="replace")
    except OSError:
        text = ""
    for line in text.split("\n")[:-1]:  # what follows the last newline is no whole line
        match = _LINE.fullmatch(line)
        if match is None:
            continue  # the end of a write that failed part-way
        added, started, ended = match.groups()
        if added is not None:
            groups[int(added)] = int(started) if started else None
        else:
            groups.pop(int(ended), None)
    return groups


def _open_record(path: Path, *, truncate: bool = False) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    return os.open(path, flags, 0o600)


def kill_process_group(pgid: int, grace: float = 5.0, *, leader_started: int | None = None) -> bool:
    """SIGTERM the group, SIGKILL it after `grace` seconds; True once no live
    process of it is left.

    `leader_started` (from `process_start_time`, recorded at spawn) guards a
    successor against PID reuse: if the group's leader is alive but started
    at another time, the group is someone else's and is left alone (False)."""
    if leader_started is not None:
        started = process_start_time(pgid)
        if started is not None and started != leader_started:
            return False
    if not signal_group(pgid, signal.SIGTERM):
        return True
    deadline = time.monotonic() + grace
    while process_group_alive(pgid):
        if time.monotonic() >= deadline:
            signal_group(pgid, signal.SIGKILL)
            return _wait_group_gone(pgid, KILL_WAIT)
        time.sleep(POLL)
    return True


def process_group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process of the group exists.

    Zombies are ignored: an orphan's zombie waits for init to reap it, which
    some inits do late or never, and a zombie runs nothing."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it is just not ours to signal
    members = _group_states(pgid)
    if members is None:  # no /proc: trust the signal probe
        return True
    return any(state not in "ZX" for state in members)


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None."""
    stat = _read_stat(pid)
    return int(stat[19]) if stat else None


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while process_group_alive(pgid):
        if time.monotonic() >= deadline:
            log.error("process group %s still has live processes after SIGKILL", pgid)
            return False
        time.sleep(POLL)
    return True


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not permitted to signal process group %s", pgid)
    return True


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 = state)."""
    try:  # one open and one read, not a text file object: it runs for every step, and for all of /proc
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            raw = os.read(fd, 4096).decode("utf-8", errors="replace")  # the command name may be any bytes
        finally:
            os.close(fd)
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _group_states(pgid: int) -> list[str] | None:
    """States of the processes in group `pgid`, or None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    states = []
    for name in entries:
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat and int(stat[2]) == pgid:
                states.append(stat[0])
    return states
